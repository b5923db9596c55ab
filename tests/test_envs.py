"""vllm/envs.py is the one place a VLLM_* variable is read: the scan of vllm/, each variable read
at access time, the reference table, and a malformed integer named in its error."""
import ast
import re
from pathlib import Path

import pytest

from vllm import envs

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vllm"
ENV_FUNCS = {"getenv", "getenvb"}                     # os.getenv(...), or imported bare


def _is_environ(node: ast.AST) -> bool:
    """os.environ, os.environb, or environ imported bare."""
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
    return name in ("environ", "environb")


def _vllm_strings(node: ast.AST, constants: dict) -> list:
    """The VLLM_* names a call argument or subscript carries: string literals (f-strings'
    literal parts too) and names bound to such a literal in the same module."""
    found = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            found.append(sub.value)
        elif isinstance(sub, ast.Name) and sub.id in constants:
            found.append(constants[sub.id])
    return [s for s in found if s.startswith("VLLM_")]


def environ_reads(source: str) -> list:
    """(line, name) of each read of a VLLM_* variable: os.environ[...], os.environ.<method>(...),
    os.getenv(...), and `... in os.environ`. Iterating os.environ (forwarding by prefix) is not a
    read of any one variable's meaning."""
    tree = ast.parse(source)
    constants = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            names = _vllm_strings(node.slice, constants)
        elif isinstance(node, ast.Call):
            f = node.func
            reads = (isinstance(f, ast.Attribute) and _is_environ(f.value)) or \
                (getattr(f, "attr", None) or getattr(f, "id", None)) in ENV_FUNCS
            names = _vllm_strings(ast.Tuple(elts=[*node.args, *(k.value for k in node.keywords)]),
                                  constants) if reads else []
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            names = _vllm_strings(node.left, constants)
        else:
            continue
        hits += [(node.lineno, name) for name in names]
    return sorted(hits)


def test_the_scan_finds_each_form_of_read():
    source = ("import os\nfrom os import environ, getenv\nN = 'VLLM_N'\n"
              "a = os.environ['VLLM_A']\nb = os.environ.get('VLLM_B', '0')\nc = os.getenv('VLLM_C')\n"
              "d = environ.get(N)\ne = getenv(key='VLLM_E')\nf = 'VLLM_F' in os.environ\n"
              "g = os.environ.get(f'VLLM_G_{a}')\nh = os.environ.pop('VLLM_H', None)\n"
              "ok = {k: v for k, v in os.environ.items() if k.startswith(('VLLM_', 'NCCL_'))}\n"
              "ok2 = os.environ.get('CC', 'cc')\n")
    assert [name for _, name in environ_reads(source)] == \
        ["VLLM_A", "VLLM_B", "VLLM_C", "VLLM_N", "VLLM_E", "VLLM_F", "VLLM_G_", "VLLM_H"]


def test_no_module_but_envs_reads_a_vllm_variable():
    files = sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "envs.py")
    assert PACKAGE / "entrypoints" / "openai" / "api_server.py" in files
    assert PACKAGE / "executor" / "ray_distributed_executor.py" in files
    reads = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in files
             for line, name in environ_reads(p.read_text())]
    assert not reads, "read these through vllm.envs:\n" + "\n".join(reads)


def test_every_vllm_name_in_the_package_and_docs_is_in_envs():
    texts = [p.read_text() for p in PACKAGE.rglob("*.py")]
    texts += [p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
              if p.exists()]
    names = {m for t in texts for m in re.findall(r"\bVLLM_[A-Z0-9_]*[A-Z0-9]\b", t)}
    assert names and names <= set(envs.environment_variables), \
        sorted(names - set(envs.environment_variables))


# name -> (a value to set, what envs returns for it, what envs returns when it is unset)
SAMPLES = {
    "VLLM_CACHE_ROOT": ("/tmp/vllm-cache", Path("/tmp/vllm-cache"),
                        Path("~/.cache/vllm").expanduser()),
    "VLLM_CPU_ISA": ("generic", "generic", None),
    "VLLM_CPU_KERNELS": ("0", False, True),
    "VLLM_CPU_GEMM": ("torch", "torch", "auto"),
    "VLLM_KERNEL_BACKEND": ("torch", "torch", None),
    "VLLM_RELOCATE_LIB": ("/opt/lib.so", "/opt/lib.so", None),
    "VLLM_RELOCATE_DEBUG": ("1", True, False),
    "VLLM_RAY_CPUS_PER_RANK": ("3", 3, 0),
    "VLLM_API_KEY": ("secret", "secret", None),
    "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": ("1", True, False),
}


@pytest.mark.parametrize("name", sorted(envs.environment_variables))
def test_each_variable_is_read_at_access(monkeypatch, name):
    assert name in SAMPLES, f"{name}: add a sample value here"
    value, when_set, when_unset = SAMPLES[name]
    monkeypatch.delenv(name, raising=False)
    assert getattr(envs, name) == when_unset
    monkeypatch.setenv(name, value)
    assert getattr(envs, name) == when_set
    monkeypatch.delenv(name)
    assert getattr(envs, name) == when_unset
    assert name in dir(envs)


def test_flags_and_unknown_names(monkeypatch):
    monkeypatch.setenv("VLLM_RELOCATE_DEBUG", "")
    assert envs.VLLM_RELOCATE_DEBUG is False
    monkeypatch.setenv("VLLM_RELOCATE_DEBUG", "0")
    assert envs.VLLM_RELOCATE_DEBUG is False
    monkeypatch.setenv("VLLM_CPU_ISA", "")
    assert envs.VLLM_CPU_ISA is None
    with pytest.raises(AttributeError, match="VLLM_NO_SUCH"):
        envs.VLLM_NO_SUCH


def test_reference_lists_every_variable():
    rows = envs.reference().splitlines()[2:]
    assert len(rows) == len(envs.environment_variables)
    for row, (name, (_, default, meaning)) in zip(rows, envs.environment_variables.items()):
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert cells == [f"`{name}`", default, meaning]         # "|" in a cell escaped


@pytest.mark.parametrize("value", ["two", "1.5"])
def test_a_malformed_integer_names_its_variable(monkeypatch, value):
    monkeypatch.setenv("VLLM_RAY_CPUS_PER_RANK", value)
    with pytest.raises(ValueError, match=f"VLLM_RAY_CPUS_PER_RANK={value!r}"):
        envs.VLLM_RAY_CPUS_PER_RANK
