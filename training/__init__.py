"""Training draft heads for speculative decoding (`moedesk train-draft`): outside the inference core, it drives
the engine as a front end does and writes a head folder that engine.speculative loads.

train: the EAGLE-1/2/3 head trained on the target's own features; self_prompts: requests the target writes
itself, added to the prompt set; files: writes that a crash cannot leave half done.
"""
