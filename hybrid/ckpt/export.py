"""`hybrid export CKPT OUT`: a consolidated model state dict as safetensors, offline, on the CPU.

Tensors are read from the sharded checkpoint a file-shard at a time (never the whole model at
once), written as HF-style `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`.
A transformers model keeps its keys (tied duplicates dropped, as transformers saves them); our own
llama/gpt2 decoders are renamed to the transformers layout (GPT-2's Conv1D weights transposed)
and get a config.json, so `AutoModelForCausalLM.from_pretrained(OUT)` loads the export.

Before anything is written, the checkpoint is read as `load` reads it (hybrid/ckpt/folder.py: confined,
sizes and CRCs, every stored item checked) and DCP's metadata is held against meta.json's params
table: the same names, shapes and dtypes, so the export has exactly the tensors load would restore.
OUT may not be, contain or lie inside the checkpoint; the temporary folder is removed on any
failure, SIGTERM and Ctrl-C included; files get the permissions the umask gives.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import threading

from .folder import check_files, first_line, read_meta, reader, short
from ..errors import HybridError
from .space import causes, why_write_failed
from ..units import parse_bytes

_LLAMA = [(r"^embed\.", "model.embed_tokens."), (r"^blocks\.(\d+)\.norm1\.", r"model.layers.\1.input_layernorm."),
          (r"^blocks\.(\d+)\.norm2\.", r"model.layers.\1.post_attention_layernorm."),
          (r"^blocks\.(\d+)\.attn\.", r"model.layers.\1.self_attn."),
          (r"^blocks\.(\d+)\.mlp\.", r"model.layers.\1.mlp."),
          (r"^norm\.", "model.norm."), (r"^lm_head\.", "lm_head.")]
_GPT2 = [(r"^embed\.", "transformer.wte."), (r"^pos_embed\.", "transformer.wpe."),
         (r"^blocks\.(\d+)\.norm1\.", r"transformer.h.\1.ln_1."),
         (r"^blocks\.(\d+)\.norm2\.", r"transformer.h.\1.ln_2."),
         (r"^blocks\.(\d+)\.attn\.qkv_proj\.", r"transformer.h.\1.attn.c_attn."),
         (r"^blocks\.(\d+)\.attn\.o_proj\.", r"transformer.h.\1.attn.c_proj."),
         (r"^blocks\.(\d+)\.mlp\.fc\.", r"transformer.h.\1.mlp.c_fc."),
         (r"^blocks\.(\d+)\.mlp\.proj\.", r"transformer.h.\1.mlp.c_proj."), (r"^norm\.", "transformer.ln_f."),
         (r"^lm_head\.", "lm_head.")]
_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "gpt2": "GPT2LMHeadModel",
         "mixtral": "MixtralForCausalLM"}     # our MoE blocks keep Mixtral's names (mlp.gate, mlp.experts.*)
_EXPORTED = re.compile(r"model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|config\.json")
"""The files an export writes: what --overwrite may replace."""


def _rename(name: str, rules) -> str:
    for pattern, repl in rules:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    raise HybridError(f"no transformers name for parameter {name!r}")


def plan_keys(meta: dict) -> tuple[list[tuple[str, str, bool]], dict | None]:
    """[(checkpoint key, exported key, transpose)] and the config.json to write (or None)."""
    dropped = {name for group in meta.get("tied", []) for name in group[1:]}
    names = [n for n in meta["params"] if n not in dropped]
    info = meta["model"]
    if "decoder" in info:
        d = info["decoder"]
        if d.get("style") not in ("llama", "gpt2"):
            raise HybridError(f"meta.json's model.decoder has style {short(d.get('style'))}; hybrid writes llama "
                              "or gpt2")
        rules = _GPT2 if d["style"] == "gpt2" else _LLAMA
        from ..model.presets import DecoderConfig
        try:
            cfg = DecoderConfig(**d).hf_config()
        except (TypeError, ValueError) as e:
            raise HybridError(f"meta.json's model.decoder is not a decoder hybrid writes: "
                              f"{str(e).splitlines()[0][:120]}") from None
        arch = _ARCH.get(cfg["model_type"])
        if arch is None:
            raise HybridError(f"meta.json's model.decoder is a {short(cfg['model_type'])} model; hybrid's own "
                              f"decoders export as {', '.join(_ARCH)}")
        cfg["architectures"] = [arch]
        transposed = re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$") if d["style"] == "gpt2" else None
        out = []
        for n in names:
            new = _rename(n, rules)
            out.append((n, new, bool(transposed and transposed.search(new))))
        return out, cfg
    return [(n, n, False) for n in names], info.get("hf_config")


def _inside(a: str, b: str) -> bool:
    """Whether path a is b or lies inside it (real paths: symbolic links resolved)."""
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def _target(out: str, overwrite: bool, ckpt: str) -> str:
    """Check the output directory before any work: a file, a non-empty directory (without
    overwrite), an unwritable parent or a place that is, holds or lies in the checkpoint is a
    HybridError."""
    out = os.path.abspath(out)
    if _inside(out, ckpt) or _inside(ckpt, out):
        where = ("is" if _inside(out, ckpt) and _inside(ckpt, out) else "lies inside" if _inside(out, ckpt)
                 else "contains")
        raise HybridError(f"export target {out!r} {where} "
                          f"the checkpoint {os.path.abspath(ckpt)!r}; export to a directory outside it")
    if os.path.exists(out) and not os.path.isdir(out):
        raise HybridError(f"export target {out!r} is a file; give a directory")
    if os.path.isdir(out) and os.listdir(out):
        if not overwrite:
            raise HybridError(f"export target {out!r} is not empty; choose a new directory, or pass --overwrite to "
                              "replace an earlier export there")
        foreign = sorted(n for n in os.listdir(out) if not _EXPORTED.fullmatch(n))
        if foreign:     # --overwrite replaces an export, never what else the folder holds
            raise HybridError(f"export target {out!r} holds {short(foreign[0])}, which an export does not write; "
                              "--overwrite replaces only an earlier export: choose a new directory")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise HybridError(f"cannot export to {out!r}: its parent directory does not exist")
    if not os.access(parent, os.W_OK):
        raise HybridError(f"cannot export to {out!r}: {parent!r} is not writable")
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def _signals_unwind():
    """SIGTERM, SIGHUP and SIGINT raise in the main thread while the export runs, so its cleanup
    runs; the handlers in force before are restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    # a signal the caller ignores stays ignored (`nohup hybrid export ...` survives the logout)
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
           if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def check_params(ckpt: str, meta: dict, md, keys) -> dict:
    """DCP's metadata against meta.json's params table: every exported parameter stored as a tensor
    of its listed shape and dtype (or the fp32 master of a 16-bit one); {name: storage entry}."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not keys:
        raise HybridError(f"checkpoint {ckpt!r} lists no parameters to export")
    stored, out, total = md.state_dict_metadata, {}, 0
    for src, _, _ in keys:
        shape, dtype = meta["params"][src]
        e = stored.get(f"model.{src}")
        if not isinstance(e, TensorStorageMetadata):
            raise HybridError(f"checkpoint {ckpt!r} has no tensor for parameter {short(src)}")
        if list(e.size) != list(shape):
            raise HybridError(f"checkpoint {ckpt!r}: parameter {short(src)} is stored with shape {tuple(e.size)}, "
                              f"meta.json lists {tuple(shape)}")
        want, have = getattr(torch, dtype), e.properties.dtype
        if have != want and not (have == torch.float32 and want in (torch.bfloat16, torch.float16)):
            raise HybridError(f"checkpoint {ckpt!r}: parameter {short(src)} is stored as {have}, meta.json lists "
                              f"{want}")
        out[src] = e
        total += e.size.numel() * have.itemsize
    held = sum(v[0] for k, v in meta["files"].items() if k.startswith("dcp/"))
    if total > held:
        raise HybridError(f"checkpoint {ckpt!r} declares {total} bytes of parameters but its files hold {held}")
    return out


def export(ckpt: str, out: str, dtype: str | None = None, max_shard: str = "5GB",
           overwrite: bool = False) -> list[str]:
    """Write the export; returns the files written. No process group, no GPU. The checkpoint is
    checked whole first; the files are written into a fresh temporary directory beside `out` and
    renamed into place at the end, so a failed or interrupted export leaves `out` as it was; a
    non-empty `out` needs overwrite=True, and `out` is checked again at the rename (`_place`)."""
    import shutil
    import uuid

    import torch

    ckpt = os.path.abspath(ckpt)
    meta = read_meta(ckpt)              # first: "this is no checkpoint" says more than where OUT lies
    out = _target(out, overwrite, ckpt)
    cast = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype not in cast:
        raise HybridError(f"unknown dtype {short(dtype)}. Available: fp32, bf16, fp16")
    limit = parse_bytes(max_shard)
    if not 1 << 10 <= limit <= 1 << 50:
        raise HybridError(f"--max-shard-size must be between 1KiB and 1PiB, got {short(max_shard)}")
    check_files(ckpt, meta)
    r = reader(ckpt, meta)
    keys, config = plan_keys(meta)
    entries = check_params(ckpt, meta, r.metadata, keys)
    parent, base, tag = os.path.dirname(out), os.path.basename(out), uuid.uuid4().hex[:8]
    tmp = os.path.join(parent, f".{base}.{tag}")         # named before it exists: cleaned whatever interrupts
    old = os.path.join(parent, f".{base}.old.{tag}")     # a replaced export, until the new one is in place
    with _signals_unwind():
        try:
            os.mkdir(tmp)                   # 0777 less the umask, as any output directory
            try:
                written = _write(ckpt, r, tmp, dtype, cast, keys, entries, config, limit)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                stop = next((x for x in causes(e) if isinstance(x, (KeyboardInterrupt, SystemExit))), None)
                if stop is not None:        # a signal that landed inside DCP, which wrapped it
                    raise stop from None
                raise _read_or_write_error(ckpt, meta, tmp, out, e) from None
            _place(tmp, out, old, overwrite)
        except HybridError:
            raise
        except OSError as e:
            raise HybridError(f"cannot export to {out!r}: {why_write_failed(e, parent) or e.strerror or e}") from None
        finally:
            if os.path.isdir(old) and not os.path.lexists(out):
                os.rename(old, out)         # stopped between the two renames: the previous export back
            for leftover in (tmp, old):     # `old` goes only where it holds nothing but an earlier export
                if os.path.isdir(leftover) and not os.path.islink(leftover) and (
                        leftover == tmp or _only_exported(leftover) is None):
                    shutil.rmtree(leftover, ignore_errors=True)
    return written


def _read_or_write_error(ckpt: str, meta: dict, tmp: str, out: str, e: BaseException) -> HybridError:
    """What stopped the export as one line: a save that replaced the version being read, a full
    disk (or quota, or file-size limit), else the first cause."""
    try:
        now = read_meta(ckpt)["data"]
    except HybridError:
        now = None
    if now != meta["data"] or not os.path.isdir(os.path.join(ckpt, meta["data"])):
        return HybridError(f"checkpoint {ckpt!r} changed while it was exported (a save replaced version "
                           f"{short(meta['data'])}); {out!r} is left as it was: export again when no save is running")
    why = why_write_failed(e, tmp)
    if why:
        return HybridError(f"cannot export to {out!r}: {why}")
    if isinstance(e, HybridError):
        return e
    if isinstance(e, OSError):
        return HybridError(f"cannot export to {out!r}: {e.strerror or e}")
    return HybridError(f"cannot export {ckpt!r}: {first_line(e)}")


def _only_exported(path: str) -> str | None:
    """The first entry of directory `path` an export does not write (or that is not a regular
    file), or None where it holds only an export's files."""
    for name in sorted(os.listdir(path)):
        if not _EXPORTED.fullmatch(name) or not os.path.isfile(os.path.join(path, name)) \
                or os.path.islink(os.path.join(path, name)):
            return name
    return None


_OCCUPIED = (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR)
"""What rename(2) says when its target is there and not an empty folder."""


def _moved(tmp: str, out: str) -> bool:
    """Rename `tmp` to `out`; False (nothing moved) when `out` is there and not an empty folder."""
    try:
        os.rename(tmp, out)
        return True
    except OSError as e:
        if e.errno not in _OCCUPIED:
            raise
        return False


def _place(tmp: str, out: str, old: str, overwrite: bool) -> None:
    """Rename the finished export `tmp` to `out`, re-checking `out` at that moment: absent or empty
    (rename(2) replaces only an empty directory, atomically), or with overwrite an earlier export
    (moved aside to `old`, checked there, removed by the caller); anything else is a HybridError
    and `out` is left as it is."""
    if _moved(tmp, out):
        return
    if os.path.isdir(out) and not os.path.islink(out):
        stranger = _only_exported(out)
        if stranger is None and not overwrite:
            raise HybridError(f"export target {out!r} was filled by another export while this one ran; it is left as "
                              "it is: export to a new directory, or pass --overwrite to replace it")
    else:
        raise HybridError(f"export target {out!r} changed while the export ran (it is now a file or a link); it is "
                          "left as it is: export to a new directory")
    if stranger is not None:
        raise HybridError(f"export target {out!r} changed while the export ran (it now holds {short(stranger)}); it "
                          "is left as it is: export to a new directory")
    os.rename(out, old)                 # an earlier export: aside, checked again where nobody else writes
    stranger = _only_exported(old)
    if stranger is None:
        if not _moved(tmp, out):
            raise HybridError(f"export target {out!r} was created again while the export ran; it is left as it is, "
                              "and the earlier export it replaced is removed: export again")
        return
    try:
        os.rename(old, out)             # a file appeared in the instant before: everything back
    except OSError:
        raise HybridError(f"export target {out!r} changed while the export ran; what it held is now in {old!r} "
                          "(nothing was deleted): move it back and export to a new directory") from None
    raise HybridError(f"export target {out!r} changed while the export ran (it now holds {short(stranger)}); it is "
                      "left as it is: export to a new directory")


def _write(ckpt, r, out, dtype, cast, keys, entries, config, limit) -> list[str]:
    import warnings

    import torch
    from safetensors.torch import save_file

    from .safeio import dcp_load
    shards, current, size = [], [], 0
    for src, dst, transpose in keys:
        entry = entries[src]
        itemsize = torch.finfo(cast[dtype]).bits // 8 if cast[dtype] else entry.properties.dtype.itemsize
        nbytes = entry.size.numel() * itemsize
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append((src, dst, transpose, entry))
        size += nbytes
    if current:
        shards.append(current)
    written, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        state = {f"model.{src}": torch.empty(e.size, dtype=e.properties.dtype) for src, _, _, e in shard}
        with warnings.catch_warnings():
            # "torch.distributed is ... uninitialized, assuming the intent is to load in a single
            # process": exactly the intent (no_dist=True); DCP warns regardless
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(state, r, no_dist=True)
        tensors = {}
        for src, dst, transpose, _ in shard:
            t = state.pop(f"model.{src}")
            t = t.t().contiguous() if transpose else t.contiguous()
            tensors[dst] = t.to(cast[dtype]) if cast[dtype] else t
            total += tensors[dst].numel() * tensors[dst].element_size()
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        try:
            save_file(tensors, os.path.join(out, name), metadata={"format": "pt"})
        except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError (a full disk, a quota)
            raise HybridError(f"cannot write {name}: {first_line(e)}") from None
        os.chmod(os.path.join(out, name), 0o666 & ~_umask())     # safetensors creates its files 0600
        weight_map.update({k: name for k in tensors})
        written.append(name)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    written.append("model.safetensors.index.json")
    if config is not None:
        config = dict(config)
        if dtype:
            config["torch_dtype"] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        written.append("config.json")
    return written
