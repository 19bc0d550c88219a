from ringbuf.buffer import RingBuffer

__all__ = ["RingBuffer"]
