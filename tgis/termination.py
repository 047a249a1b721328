"""Fatal errors: one line on stderr, the same line in the termination log, non-zero exit.

Used by all three processes: `fail_startup` for errors they expect (configuration, model,
ports), and `tgis.log`'s uncaught-exception hook for the others. The file itself is
`tgis.termination_log`'s.
"""

from __future__ import annotations

import sys
from typing import NoReturn

from tgis.log import fatal_line, one_line
from tgis.termination_log import write_termination_log


def fail_startup(message: str, exit_code: int = 1) -> NoReturn:
    """Report a configuration or start-up error (one line; a JSON object under
    --json-output) and exit."""
    message = one_line(message)
    print(fatal_line(message), file=sys.stderr, flush=True)
    write_termination_log(message)
    sys.exit(exit_code)
