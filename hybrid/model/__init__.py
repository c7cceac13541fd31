"""What a model is: its profile, its presets, and the decoders we build (torch only in decoder.py and convnet.py)."""
