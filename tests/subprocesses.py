"""Where the tests' ``python -c`` and ``python -m`` subprocesses run.

Such a process puts its working directory first on ``sys.path``; run from a
checkout, the checkout's unbuilt ``fastbatch`` would shadow the installed
wheel that the tests are about.  The standard library's folder holds no
``fastbatch``.
"""

import os

OUTSIDE_THE_CHECKOUT = os.path.dirname(os.__file__)
