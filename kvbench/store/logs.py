"""Keep the console readable: our progress and results, not third-party warning spam."""

from __future__ import annotations

import logging
import warnings


def quiet_libraries() -> None:
    for name in ("transformers", "datasets", "lm-eval", "lm_eval", "httpx", "urllib3", "filelock"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
