"""ssdsl: DNN parallelization plans as compositions of partition, replicate, assign and order."""

__version__ = "0.1.0"
