class LoadStats:
    pass


def load(state_dict, checkpoint_dir, **kwargs):
    raise NotImplementedError


async def load_async(state_dict, checkpoint_dir, **kwargs):
    raise NotImplementedError
