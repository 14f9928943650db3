"""Module-level host wrappers: ``gpunet.init`` and ``gpunet.put`` & co. on the current Context.

Shapes and dtypes: every tensor argument is a contiguous CPU tensor of any dtype inside the
symmetric heap (``ctx.alloc``); sizes are in bytes of the local tensor; a Remote
(``ctx.remote(rank, tensor, offset)``) names the same tensor on another rank.
"""
from gpunet import context as _context
from gpunet.context import Context, DeviceHandle, Remote, read_signal  # noqa: F401 - re-exported
from gpunet.extension import build_extension  # noqa: F401 - re-exported


def init(group=None, transport="auto", nic="auto", **kwargs):
    """Start gpunet on this rank and return its Context (a context manager).

    ``group``: a torch.distributed process group (default: the initialised default group, or
    torchrun's environment, or a single rank); ``transport``: "auto" | "ibgda" | "proxy" | "p2p";
    ``nic``: "auto" | "soft" | "verbs". Keyword arguments go to :class:`gpunet.context.Context`
    (heap_bytes, timeout_s, warp_size, proxy_threads).

    Collective over the group: an argument of the wrong type or range, or a resource that cannot
    be made, raises a gpunet error (ConfigError for bad input) on EVERY rank, promptly. The new
    Context becomes the current one (what ``gpunet.put`` & co. use without ``ctx=``) until it is
    closed; then the previously opened one still open is current again.
    """
    ctx = Context(group=group, transport=transport, nic=nic, **kwargs)
    _context._make_current(ctx)
    return ctx


def put(remote, tensor, ctx=None):
    """Non-blocking: copy heap ``tensor`` to ``remote``. Complete after :func:`quiet`. To a p2p
    peer the device threads copy the bytes, so the launch gets blocks for the size
    (gpunet/_launch.py bulk_geometry); to a NIC peer one WQE carries it."""
    (ctx or _context.current()).put(remote, tensor)


def put_batch(pairs, ctx=None):
    """Non-blocking: ``pairs`` is a list of ``(remote, tensor)``; every put in ONE device launch
    (p2p peers: a launch of blocks sized to the bytes). Complete after :func:`quiet`."""
    (ctx or _context.current()).put_batch(pairs)


def get(tensor, remote, ctx=None):
    """Non-blocking: copy ``remote`` into heap ``tensor``. Complete after :func:`quiet`."""
    (ctx or _context.current()).get(tensor, remote)


def put_signal(remote, tensor, signal, value=1, ctx=None, op="add"):
    """Put, then add ``value`` to (``op="set"``: store it in) the 8-byte ``signal`` on the same
    rank, in that order."""
    (ctx or _context.current()).put_signal(remote, tensor, signal, value, op=op)


def atomic_add(remote, value, ctx=None):
    """Fetch-and-add on the 8-byte word at ``remote`` (in the NICs' atomic order: native by
    default, Context.atomic_add); returns the old value."""
    return (ctx or _context.current()).atomic_add(remote, value)


def wait_until(signal, value, cmp="ge", index=0, ctx=None):
    """Bounded wait until the NIC-updated int64 signal ``signal[index]`` compares ``cmp`` to
    ``value`` ("eq" | "ne" | "ge" | "gt" | "le" | "lt"); raises gpunet.TimeoutError."""
    (ctx or _context.current()).wait_until(signal, value, cmp, index)


def quiet(ctx=None):
    """Wait for every operation this rank issued to complete."""
    (ctx or _context.current()).quiet()


def barrier(ctx=None):
    """All ranks meet (through the NIC; bounded)."""
    (ctx or _context.current()).barrier()
