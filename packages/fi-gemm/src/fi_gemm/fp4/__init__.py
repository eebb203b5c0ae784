"""FP4 (NVFP4 / MXFP4) GEMM and quantisers."""
