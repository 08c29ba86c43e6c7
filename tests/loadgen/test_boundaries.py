"""Import boundaries of the load generator and the simulator, checked in fresh
interpreters: `loadgen/` (a client) pulls in nothing from `worker/` or `service/`, nor
torch or transformers, even when it loads its tokenizer and builds a workload;
`loadgen/sim/` imports the scheduler and nothing from `service/` or `worker/`; and without
matplotlib (the `plots` extra) every command runs except the plotting ones, which say what
to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("worker", "service", "torch", "transformers")

_IMPORT_ALL = """
import importlib, pkgutil, sys
import {package}
names = [m.name for m in pkgutil.walk_packages({package}.__path__, "{package}.") if m.name not in {skip!r}]
for name in names:
    importlib.import_module(name)
{extra}
bad = sorted({{m.split(".")[0] for m in sys.modules}} & set({forbidden!r}))
print("imported", len(names), "modules; forbidden:", bad)
sys.exit(1 if bad else 0)
"""


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_loadgen_imports_no_worker_service_or_torch_even_with_its_tokenizer() -> None:
    extra = """
from loadgen.tokenizer import load_tokenizer
from loadgen.workloads import LengthDist, synthetic
tok = load_tokenizer()
reqs = synthetic(3, LengthDist.parse("16"), LengthDist.parse("4"), tokenizer=tok)
assert all(len(tok.encode(r.prompt_text, add_special_tokens=False)) == 16 for r in reqs)
"""
    res = _python(_IMPORT_ALL.format(package="loadgen", skip=[], extra=extra, forbidden=FORBIDDEN))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "forbidden: []" in res.stdout


def test_simulator_imports_no_service_or_worker() -> None:
    res = _python(_IMPORT_ALL.format(package="loadgen.sim", skip=[], extra="", forbidden=("worker", "service", "torch")))
    assert res.returncode == 0, res.stdout + res.stderr


_NO_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None  # as if the plots extra were not installed
from loadgen.sim.cli import main as simulate
from loadgen.bench import main as bench
run = ["--num-prompts", "5", "--request-rate", "inf", "--prompt-len", "16", "--output-len", "4"]
print("plain", simulate(run))
print("timeline", simulate([*run, "--timeline", "t.png"]))
print("sweep", simulate(["sweep", *run, "--param", "max_num_seqs", "1,2", "--plot", "s.png"]))
print("bench", bench(["--base-url", "http://127.0.0.1:9", "--no-tokenizer", "--plot", "d", *run]))
"""


def test_plot_flags_without_matplotlib_say_what_to_install(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-c", _NO_MATPLOTLIB], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    lines = dict(line.split() for line in res.stdout.splitlines() if line.split()[0] in ("plain", "timeline", "sweep", "bench"))
    assert lines == {"plain": "0", "timeline": "2", "sweep": "2", "bench": "2"}, res.stdout + res.stderr
    assert res.stderr.count("pip install 'stepserve[plots]'") == 3
    assert not list(tmp_path.iterdir())  # nothing was run or written before the refusal
