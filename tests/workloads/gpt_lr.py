"""``examples/gpt.py``'s workload at a third of its learning rate: a run resumed with a new setting
(tests/test_checkpoint.py)."""
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("gpt_example",
                                               Path(__file__).resolve().parents[2] / "examples" / "gpt.py")
_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpt)
batches = _gpt.batches


def workload():
    return _gpt.workload(lr=1e-4)
