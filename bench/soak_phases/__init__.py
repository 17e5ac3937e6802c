"""The phases of the reliability soak, one module each; `bench/soak.py` runs them (see its
docstring for the command, the flags and the figures).

Modules: common (layout, page contents, `Pager`, `running_daemon`, /proc readers), kill,
client_kill, load, corruption, fuzz, full_disk, remote; each exports `phase_<name>(work, ...)`
returning that phase's figures. Imported as `soak_phases` with bench/ on sys.path (a script's
own directory is).
"""
