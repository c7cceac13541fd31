"""Every layout judged on memory and speed: candidates, the batch search, the plan and its report."""
