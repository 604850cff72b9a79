import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def root() -> Path:
    return ROOT
