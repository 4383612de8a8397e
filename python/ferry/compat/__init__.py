"""ferry's compatibility layers: the APIs inference engines already call, over ferry's AllToAll.

- `ferry.compat.deep_ep`: DeepEP's `deep_ep` package (Buffer, Config, EventOverlap), its
  low-latency, normal and shrink modes;
- `ferry.compat.pplx`: pplx-garden's `AllToAllKernel`;
- `ferry.compat.pplx_kernels`: pplx-kernels' older `AllToAll`, over `ferry.compat.pplx`.

Each is importable under its former name too (`ferry.deep_ep`, `ferry.pplx`,
`ferry.pplx_kernels`: the same modules), and as the API's own name through the shim packages
(`shim_path()` of each, for PYTHONPATH).
"""
