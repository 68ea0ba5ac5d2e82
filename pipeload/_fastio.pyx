# placeholder: replaced by the real reader
