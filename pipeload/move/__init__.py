"""Moving tensor regions from the ranks that hold them to the ranks that need them.

Both the memory tier's restore (a tier file is the source) and the live transfer (a trainer's tensors
are the source) cut their work into regions of global tensors (:mod:`.regions`) and move them point to
point in one global order (:mod:`.mover`), over a :class:`pipeload.engine.comm.Comm` or, for a group
that need not lie in the default world, a :class:`.link.Link`.
"""
