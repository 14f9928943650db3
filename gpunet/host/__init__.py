"""Everything gpunet runs on the CPU: platform, soft NIC, proxy, verbs, bootstrap."""
