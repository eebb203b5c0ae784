"""flashinfer.fp4_quantization: FP4 quantisers and the scale-layout enum (from the fi-gemm
package; also flat on `flashinfer` and in `flashinfer.gemm`)."""

from ._family import reexport

reexport(globals(), "fi-gemm", "fi_gemm.fp4.quant")
