"""Reading bytes: the compiled safetensors reader over mmap (``_fastio``), the ReadItem copies into
destinations (``reader``), checksums, and the storage backends under them.
"""
