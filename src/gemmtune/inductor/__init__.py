"""gemmtune inside ``torch.compile``: the compiled graphs' GEMMs run as gemmtune chose them.

``backend`` is the entry (``gemmtune.compile``); ``choices`` answers the compiler's GEMM
lowerings; ``problems`` reads a lowering's operands as a gemmtune ``Problem``; ``epilogues``
the activation each linear layer feeds alone, from Dynamo's graph; ``runtime`` is
what generated code calls for a gemmtune kernel; ``hooks`` holds every compiler extension point
gemmtune uses, with the check that they are all there.
"""
