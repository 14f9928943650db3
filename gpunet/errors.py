"""gpunet's exceptions: every error the library raises is a GpunetError subclass.

Messages say what went wrong and what to do about it.
"""


class GpunetError(Exception):
    """Base class of every gpunet error."""


class ConfigError(GpunetError):
    """Bad input or configuration, detected before anything was posted."""


class ToolchainError(GpunetError):
    """A compiler or runtime library that gpunet needs is missing."""


class TimeoutError(GpunetError):  # noqa: A001 - the name DESIGN.md gives it
    """A bounded wait (device or host) ran out before the condition held."""


class CompletionError(GpunetError):
    """An error CQE: carries the decoded mlx5 syndrome, the QP and the WQE index."""

    def __init__(self, message, syndrome=None, vendor_syndrome=None, qpn=None, wqe_counter=None):
        super().__init__(message)
        self.syndrome = syndrome
        self.vendor_syndrome = vendor_syndrome
        self.qpn = qpn
        self.wqe_counter = wqe_counter


class CoherenceViolation(GpunetError):
    """Strict coherence mode: the NIC touched memory it cannot see coherently on this platform."""


class ClosedError(GpunetError):
    """A resource was used after close()."""


class CloseError(GpunetError):
    """Releasing a resource failed (gpunet.resource.Resource.close): everything else was still
    released. ``errors``: every failure, as (what, exception) pairs in the order they happened."""

    def __init__(self, message, errors=()):
        super().__init__(message)
        self.errors = list(errors)


class EPTimeout(TimeoutError):
    """An expert-parallel dispatch / combine (gpunet.ep) gave up on peers that stayed silent or
    failed, and the Buffer was asked to raise rather than mask them (enable_shrink=False).

    Attributes: ``phase`` ("dispatch" | "combine" | "clean"), ``peers_silent`` (sorted list of the
    ranks that never answered or failed), ``counts_seen`` (dict rank -> what arrived from it this
    call: messages or rows, None for a silent rank).
    """

    def __init__(self, message, phase=None, peers_silent=(), counts_seen=None):
        super().__init__(message)
        self.phase = phase
        self.peers_silent = sorted(int(p) for p in peers_silent)
        self.counts_seen = dict(counts_seen or {})


def with_hint(err, hint):
    """``err`` with ``hint`` (a sentence, e.g. a NIC's timeout_hint) appended to its message, the
    class and attributes kept; ``err`` unchanged when ``hint`` is empty."""
    if hint and err is not None and err.args:
        err.args = ("%s; %s" % (err.args[0], hint),) + tuple(err.args[1:])
    return err
