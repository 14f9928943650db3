"""gpunet device code: C++ headers and kernels (package data) and their loader."""
