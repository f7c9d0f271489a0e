"""What the pieces' FASTBATCH_VERIFY tests share."""

import contextlib

import fastbatch
from fastbatch import _kernels, registry


@contextlib.contextmanager
def applied_with_verify(name, rate):
    """Piece ``name`` applied with ``rate`` of its calls checked (its main
    patch yielded); its earlier state (stock, or applied at its earlier rate)
    back afterwards, with the real kernel functions in ``fastbatch`` (a test
    plants a wrong one after the activation check)."""
    piece = registry.piece(name)
    before = piece.main.verify_rate if piece.is_applied() else None
    piece.revert()
    assert piece.apply(verify=rate)
    try:
        yield piece.main
    finally:
        for function in _kernels.PIECES[name].__all__:
            setattr(fastbatch, function, getattr(_kernels, function))
        piece.revert()
        if before is not None:
            assert piece.apply(verify=before)
