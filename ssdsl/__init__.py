"""ssdsl: DNN parallelization plans as compositions of partition, replicate, assign and order."""

__version__ = "0.1.0"

__all__ = ["parallelize", "ParallelModel", "__version__"]


def __getattr__(name: str):
    # Lazy: importing ssdsl (for the command line, say) does not pull in torch.distributed.
    if name in ("parallelize", "ParallelModel"):
        from ssdsl import api
        return getattr(api, name)
    raise AttributeError(f"module 'ssdsl' has no attribute {name!r}")
