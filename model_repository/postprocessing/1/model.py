"""Triton Python-backend entry point of the `postprocessing` model; the logic lives in inflight.serving."""
import os
import sys

# the engine package: backend_src/ beside model_repository/ in a checkout, INFLIGHT_BACKEND_SRC for a
# copied repository (the stub ignores PYTHONPATH), or installed into the server's Python
_SRC = os.environ.get("INFLIGHT_BACKEND_SRC") or os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "backend_src"))
if os.path.isdir(_SRC) and _SRC not in sys.path:
    sys.path.insert(0, _SRC)

import triton_python_backend_utils as pb_utils  # noqa: E402

from inflight.serving.triton_models import PostprocessingModel  # noqa: E402


class TritonPythonModel(PostprocessingModel):
    def __init__(self):
        super().__init__(pb_utils)
