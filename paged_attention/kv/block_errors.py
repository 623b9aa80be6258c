"""The block manager's errors (raised by ``BlockManager`` and its per-sequence tables; the
pools raise none: their callers check first)."""


class BlockManagerError(Exception):
    """Base class of the block manager's errors."""


class OutOfBlocksError(BlockManagerError):
    pass


class UnknownSequenceError(BlockManagerError, KeyError):
    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class DuplicateSequenceError(BlockManagerError, ValueError):
    pass


class DoubleFreeError(BlockManagerError):
    pass


class SwapError(BlockManagerError):
    pass
