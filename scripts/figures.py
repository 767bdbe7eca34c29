"""The paper's figures from any set of results: the command line of `scripts.reports.figures` (`--help`).

python scripts/figures.py results/<experiment> [--out paper_figures]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.reports.figures import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
