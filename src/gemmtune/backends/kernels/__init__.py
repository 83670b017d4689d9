"""``@triton.jit`` kernels only; their launch wrappers live in the backend modules."""
