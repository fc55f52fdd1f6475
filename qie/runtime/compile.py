"""Regional compilation: the transformer's repeated block compiled with torch.compile, the rest left eager.

diffusers' `ModelMixin.compile_repeated_blocks` compiles every module whose class the model lists in
`_repeated_blocks`; the blocks share one class and one code object, so dynamo compiles the block once and reuses
the graph for every layer. Shapes are marked dynamic, so the buckets of a run (other latent sizes, prompt lengths)
reuse the same graph instead of compiling one per shape; torch's `recompile_limit` bounds what is left.
LoRA layers, gradient checkpointing (it calls the compiled block) and block swap (hooks around the block) stay as
they are; the weights and their names do not change, so checkpoints and LoRA files are the eager ones.
"""

from __future__ import annotations

import time

import torch

from qie.errors import ConfigError


def compile_blocks(model: torch.nn.Module, what: str = "train.compile") -> str:
    """Compile `model`'s repeated blocks in place (lazily: the first forward compiles); returns a log line.

    Raises:
        ConfigError: the model names no repeated block (`_repeated_blocks`), or torch.compile is unavailable.
    """
    names = tuple(getattr(model, "_repeated_blocks", None) or ())
    compile_repeated = getattr(model, "compile_repeated_blocks", None)
    if not names or compile_repeated is None:
        raise ConfigError(f"{what}=true: {type(model).__name__} names no repeated block to compile; set {what}=false")
    if not hasattr(torch, "compile"):
        raise ConfigError(f"{what}=true needs torch.compile (torch >= 2.0); set {what}=false")
    count = sum(1 for m in model.modules() if type(m).__name__ in names)
    t0 = time.perf_counter()
    compile_repeated(dynamic=True)
    limit = getattr(torch._dynamo.config, "recompile_limit", None) or torch._dynamo.config.cache_size_limit
    return (
        f"qie: {what}: {count} {'/'.join(names)} blocks compiled as one region with dynamic shapes (one graph for "
        f"every bucket; at most {limit} recompilations), set up in {time.perf_counter() - t0:.1f} s; the first "
        "step compiles"
    )
