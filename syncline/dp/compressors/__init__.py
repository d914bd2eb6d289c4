"""Gradient compressors for :class:`~syncline.dp.DataParallel`: fewer bytes per allreduce.

Each plugs into the :class:`~syncline.dp.compression.Compressor` protocol and talks to the
network only through the :class:`~syncline.comm.Collective` it is handed:

==========  ===========================================  =================================
name        what goes on the wire (bucket of n elements)  paper
==========  ===========================================  =================================
fp16/bf16   2n bytes, allreduce                           GradientFlow (Sun et al. 2019)
csc         4N scores + 2 * (selected chunks) bytes       GradientFlow CSC; DGC momentum
topk        k(4+4) bytes, allgather                       DGC (Lin et al. 2018)
powersgd    4r(a+b) per weight + 4 per other element      Vogels et al. 2019 (per tensor)
==========  ===========================================  =================================

Example:
    >>> dp = DataParallel(model, compression=build_compressor("csc:0.01:warmup=50"))
"""

from syncline.dp.compressors.csc import CSC
from syncline.dp.compressors.halfwidth import BF16, FP16
from syncline.dp.compressors.powersgd import PowerSGD
from syncline.dp.compressors.topk import TopK
from syncline.dp.registry import COMPRESSORS, CompressorSpec, build_compressor

__all__ = [
    "BF16",
    "COMPRESSORS",
    "CSC",
    "FP16",
    "CompressorSpec",
    "PowerSGD",
    "TopK",
    "build_compressor",
]
