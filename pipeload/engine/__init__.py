"""Running a load: orchestration (``loader``), the asyncio read -> broadcast pipeline
(``scheduler``), and the only module that calls torch.distributed (``comm``).
"""
