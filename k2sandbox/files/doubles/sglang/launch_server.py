"""`python3 -m sglang.launch_server` -- k2fleet-test-double shim (TEST DOUBLE)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from k2fleet_doubles.sglang import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
