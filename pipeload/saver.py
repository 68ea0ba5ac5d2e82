def save(state_dict, checkpoint_dir, *, process_group=None):
    raise NotImplementedError
