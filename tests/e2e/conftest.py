"""The e2e engines run on an asynchronous device unless a test names one: the
threaded backend, whose executions run after ``enqueue`` returns, as an
accelerator's do. A CPU user's default (``auto``) runs them inline, inside
``enqueue``, where a buffer the host rewrites too early or a processor state
read out of order cannot show; the engines that name ``inline``
(test_engine_features.py, test_device_faults.py) keep that fast path covered.
"""

import os
from collections.abc import Iterator

import pytest

DEVICE = "VLLM_NEURON_SCHED_DEVICE"


@pytest.fixture(scope="module", autouse=True)
def asynchronous_device() -> Iterator[None]:
    """Module-scoped, so it is set before the modules' shared engines start
    (autouse fixtures come first in their scope) and undone after them."""
    with pytest.MonkeyPatch.context() as env:
        if DEVICE not in os.environ:
            env.setenv(DEVICE, "thread")
        yield
