"""The paper's tables from any set of results, as Markdown and LaTeX: the command line of
`scripts.reports.tables` (`--help`).

python scripts/tables.py results/<experiment>            # -> results/<experiment>/tables/
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.reports.tables import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
