# the committed versions of files a helper is editing here (the device gets the working tree)
cp _calls/head/buffer.py gpunet/ep/buffer.py; cp _calls/head/ep_jobs.py tests/ep_jobs.py; cp _calls/head/test_ep_ll.py tests/test_ep_ll.py
