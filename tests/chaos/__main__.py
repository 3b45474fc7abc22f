from __future__ import annotations

import sys

from tests.chaos import run

sys.exit(run.main())
