"""Old import path of `mmkit.eval.scenes` (documented in the README before the eval package): the
same module object, so attributes read and patched through either path are the same."""

import sys

from mmkit.eval import scenes as _module

sys.modules[__name__] = _module
