"""The grammar engine (llguidance): compiled constraints cached by their canonical key, one matcher per
sequence, token masks applied to the logits before sampling."""
