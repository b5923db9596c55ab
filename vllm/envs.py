"""Every VLLM_* environment variable the engine reads: name, default and meaning, in one place.

Read them as attributes, `envs.VLLM_CPU_ISA`; each access reads the environment again, so a
variable set (or monkeypatched) after import counts, unless the caller keeps what it read
(vllm.kernels.ops reads VLLM_KERNEL_BACKEND once at import; cpu_kernels.active_isa() caches).
No other module reads os.environ for a VLLM_* name (tests/test_envs.py). `reference()` renders
this table for the docs.
"""
import os
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple


def _str(name: str) -> Optional[str]:
    """The variable's value; unset and empty are both None."""
    return os.environ.get(name) or None


def _flag(name: str) -> bool:
    """Unset, empty and "0" are off; anything else is on."""
    return os.environ.get(name, "0") not in ("", "0")


def _int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected an integer") from None


# name -> (read, default as the docs show it, meaning)
environment_variables: Dict[str, Tuple[Callable[[], Any], str, str]] = {
    "VLLM_CACHE_ROOT": (
        lambda: Path(_str("VLLM_CACHE_ROOT") or "~/.cache/vllm").expanduser(),
        "~/.cache/vllm",
        "where the engine keeps what it builds once: converted GGUF models, compiled CPU "
        "kernels and their load-time plans, the JIT relocation library"),
    "VLLM_CPU_ISA": (
        lambda: _str("VLLM_CPU_ISA"), "the best this CPU runs",
        "avx512 | avx2 | generic: the instruction-set variant the C kernels are built for; "
        "one this CPU cannot run is a ValueError"),
    "VLLM_CPU_KERNELS": (
        lambda: os.environ.get("VLLM_CPU_KERNELS", "1") != "0", "1",
        "0: never build or load the C CPU kernels (every op takes its torch path)"),
    "VLLM_CPU_GEMM": (
        lambda: os.environ.get("VLLM_CPU_GEMM", "auto"), "auto",
        "auto | c | mkl | torch: force one CPU GEMM path in every batch band instead of the "
        "load-time plan"),
    "VLLM_KERNEL_BACKEND": (
        lambda: _str("VLLM_KERNEL_BACKEND"), "unset",
        "cuda | triton | cpu | torch: force that attention / relocation path where an op has it "
        "(read once, when vllm.kernels.ops is imported; ops.forced_backend() overrides it)"),
    "VLLM_RELOCATE_LIB": (
        lambda: _str("VLLM_RELOCATE_LIB"), "the checked-in library",
        "CUDA: path of a relocation library to load instead of the checked-in one; 0, none, "
        "off or false skips it"),
    "VLLM_RELOCATE_DEBUG": (
        lambda: _flag("VLLM_RELOCATE_DEBUG"), "0",
        "1: range-check relocation slots on the host before every launch (a device sync)"),
    "VLLM_RAY_CPUS_PER_RANK": (
        lambda: _int("VLLM_RAY_CPUS_PER_RANK", 0), "this node's cores / ranks",
        "Ray on CPU: the CPUs each rank's bundle reserves (0: the default)"),
    "VLLM_API_KEY": (
        lambda: _str("VLLM_API_KEY"), "unset",
        "the server's --api-key when the flag is not given"),
    "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": (
        lambda: _flag("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH"), "0",
        "1: the server stays up (answering 500) after its engine died instead of exiting"),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name][0]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(environment_variables))


def reference() -> str:
    """The variables as a Markdown table (the docs' environment-variable reference); a "|" in
    a cell is escaped so that it does not end the cell."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| Variable | Default | Meaning |", "|---|---|---|"]
    rows += [f"| `{name}` | {cell(default)} | {cell(meaning)} |"
             for name, (_, default, meaning) in environment_variables.items()]
    return "\n".join(rows) + "\n"
