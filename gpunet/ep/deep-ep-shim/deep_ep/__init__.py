"""``import deep_ep`` gives gpunet.ep, in every process that has this folder's parent on its path.

Not an importable part of gpunet (its folder's name is not a Python identifier): a user opts in,
for programs that import ``deep_ep`` by name in processes they do not control (vLLM's and
SGLang's worker processes), with
    export PYTHONPATH="$(python -m gpunet ep-shim):$PYTHONPATH"
This module then hands ``deep_ep`` over to gpunet.ep (install_as_deep_ep), so ``import deep_ep``
returns gpunet.ep itself, and ``deep_ep.buffer`` / ``deep_ep.utils`` are gpunet's modules.
"""
__gpunet_shim__ = True  # install_as_deep_ep may replace this module, and no other deep_ep

from gpunet.ep import install_as_deep_ep  # noqa: E402

install_as_deep_ep()
