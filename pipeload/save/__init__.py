"""``pipeload.save()``: planning a save, writing each rank's file, the atomic commit.
"""
