"""One lifecycle for every object that owns something to release (ground floor: imports only
gpunet.errors).

Every resource owner of gpunet derives from :class:`Resource`: the Context, the NIC (gpunet/host/nic.py),
the proxy engine and channels, platform allocations, device-memory copies and the GPU mapping of
the NIC, the bootstrap. The contract, the same for all of them
(tests/test_resource.py checks it for every subclass):

- ``close()`` is idempotent: after the first call ``closed`` is True and later calls do nothing.
  It may be called on a half-built object (a constructor that fails calls it), so ``_release``
  must cope with attributes that were never set.
- A context manager: ``with X(...) as x:`` closes ``x`` at the end of the block, also when the
  block raised (the block's exception is what propagates; a close failure is added to it as a
  note).
- Children close before their parent, last adopted first (``_adopt``): a child is made after what
  it depends on, so it goes first. Then the object's own ``_release()`` runs. Like rdma-core's
  DevX rule: a QP before its CQ, a CQ before its UMEM, everything before the context.
- Every failure is collected and close goes on releasing the rest; at the end ONE
  :class:`gpunet.errors.CloseError` names them all (``.errors``: (what, exception) pairs).
"""
from gpunet.errors import CloseError


class Resource:
    """Base of every gpunet resource owner. Subclasses implement ``_release()`` (their own
    teardown, run after their children) and register children with ``_adopt(child, name)``; they
    do not override ``close`` / ``__enter__`` / ``__exit__``."""

    closed = False

    def _adopt(self, child, name=None):
        """Close ``child`` (a Resource, or any callable that releases something) before this object's
        own ``_release``, in reverse order of adoption. Returns ``child``."""
        kids = self.__dict__.setdefault("_children", [])
        kids.append((name or _name_of(child), child))
        return child

    def _release(self):
        """The object's own teardown, after its children. Override; the default releases nothing."""

    def close(self):
        """Release everything this object owns (children first, last adopted first, then its own
        ``_release``); idempotent; raises one CloseError listing every failure after trying all."""
        if self.closed:
            return
        self.closed = True          # first: a child that calls back into close() finds it closed
        errors = []
        kids = self.__dict__.pop("_children", [])
        for name, child in reversed(kids):
            try:
                child.close() if isinstance(child, Resource) else child()
            except CloseError as e:
                errors.extend(("%s: %s" % (name, what), err) for what, err in e.errors)
            except Exception as e:  # noqa: BLE001 - release the rest, then report everything
                errors.append((name, e))
        try:
            self._release()
        except CloseError as e:
            errors.extend(e.errors)
        except Exception as e:  # noqa: BLE001
            errors.append((type(self).__name__, e))
        if errors:
            raise CloseError("closing %s: %s" % (type(self).__name__, "; ".join(
                "%s: %s: %s" % (what, type(err).__name__, err) for what, err in errors)), errors)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            self.close()
        else:
            self._close_noting(exc)
        return False

    def _close_noting(self, exc):
        """``close()`` while ``exc`` propagates (a ``with`` block's or a failed constructor's
        failure): a CloseError is added to ``exc`` as a note instead of replacing it."""
        try:
            self.close()
        except CloseError as e:
            # the block's failure is the one to see; what close could not release is noted on it
            exc.add_note("while handling it, %s" % e)


def _name_of(child):
    return type(child).__name__ if isinstance(child, Resource) else getattr(
        child, "__qualname__", repr(child))
