# Print an optspec for argparse to handle cmd's options that are independent of any subcommand.
function __fish_cairn_global_optspecs
    string join \n c/config= h/help V/version
end

function __fish_cairn_needs_command
    # Figure out if the current invocation already has a command.
    set -l cmd (commandline -opc)
    set -e cmd[1]
    argparse -s (__fish_cairn_global_optspecs) -- $cmd 2>/dev/null
    or return
    if set -q argv[1]
        # Also print the command, so this can be used to figure out what it is.
        echo $argv[1]
        return 1
    end
    return 0
end

function __fish_cairn_using_subcommand
    set -l cmd (__fish_cairn_needs_command)
    test -z "$cmd"
    and return 1
    contains -- $cmd[1] $argv
end

complete -c cairn -n "__fish_cairn_needs_command" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_needs_command" -s h -l help -d 'Print help (see more with \'--help\')'
complete -c cairn -n "__fish_cairn_needs_command" -s V -l version -d 'Print version'
complete -c cairn -n "__fish_cairn_needs_command" -f -a "run" -d 'Run the agent in the foreground until SIGINT/SIGTERM (drains, exits 0); SIGHUP reloads the safe parts of the config'
complete -c cairn -n "__fish_cairn_needs_command" -f -a "validate" -d 'Check the configuration; print every problem (exit 2) or a summary (exit 0)'
complete -c cairn -n "__fish_cairn_needs_command" -f -a "inspect" -d 'Look inside the log or the store (the store only while the agent is stopped)'
complete -c cairn -n "__fish_cairn_needs_command" -f -a "verify" -d 'Check the log (and the store against it); `--repair` moves damaged log segments aside'
complete -c cairn -n "__fish_cairn_needs_command" -f -a "status" -d 'The running agent\'s figures (from its socket in the data directory, or `[metrics] listen`), or the data directory\'s'
complete -c cairn -n "__fish_cairn_needs_command" -f -a "savepoint" -d 'Portable snapshots of the store: create (agent stopped), list, restore'
complete -c cairn -n "__fish_cairn_needs_command" -f -a "outbox" -d 'Results waiting to go out: list them, or drop one stuck result (agent stopped)'
complete -c cairn -n "__fish_cairn_needs_command" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c cairn -n "__fish_cairn_using_subcommand run" -l reset-pipeline -d 'Drop this pipeline\'s stored state, its dedup ledger included (an event ID it saw before is applied again), and start it empty, in a new generation of output IDs (after a change to its definition that would misread the old state). For a pipeline no longer configured, delete its stored state for good. Repeatable' -r
complete -c cairn -n "__fish_cairn_using_subcommand run" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand run" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand validate" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand validate" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and not __fish_seen_subcommand_from log state dedup outbox checkpoints dead-letters help" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and not __fish_seen_subcommand_from log state dedup outbox checkpoints dead-letters help" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and not __fish_seen_subcommand_from log state dedup outbox checkpoints dead-letters help" -f -a "log" -d 'Records in the replay log'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and not __fish_seen_subcommand_from log state dedup outbox checkpoints dead-letters help" -f -a "state" -d 'Per-key aggregate state'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and not __fish_seen_subcommand_from log state dedup outbox checkpoints dead-letters help" -f -a "dedup" -d 'The event-ID dedup ledger'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and not __fish_seen_subcommand_from log state dedup outbox checkpoints dead-letters help" -f -a "outbox" -d 'Results waiting for the broker\'s PUBACK'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and not __fish_seen_subcommand_from log state dedup outbox checkpoints dead-letters help" -f -a "checkpoints" -d 'Checkpoint history, newest last'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and not __fish_seen_subcommand_from log state dedup outbox checkpoints dead-letters help" -f -a "dead-letters" -d 'Refused inputs with offset, topic and reason'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and not __fish_seen_subcommand_from log state dedup outbox checkpoints dead-letters help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from log" -l from -d 'First offset to show' -r
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from log" -l limit -r
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from log" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from log" -l json
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from log" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from state" -l pipeline -d 'Only this pipeline' -r
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from state" -l key -d 'Only this key' -r
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from state" -l limit -d 'At most this many lines' -r
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from state" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from state" -l json -d 'One JSON object per line'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from state" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from dedup" -l pipeline -d 'Only this pipeline' -r
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from dedup" -l key -d 'Only this key' -r
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from dedup" -l limit -d 'At most this many lines' -r
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from dedup" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from dedup" -l json -d 'One JSON object per line'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from dedup" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from outbox" -l pipeline -d 'Only this pipeline' -r
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from outbox" -l key -d 'Only this key' -r
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from outbox" -l limit -d 'At most this many lines' -r
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from outbox" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from outbox" -l json -d 'One JSON object per line'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from outbox" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from checkpoints" -l pipeline -d 'Only this pipeline' -r
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from checkpoints" -l key -d 'Only this key' -r
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from checkpoints" -l limit -d 'At most this many lines' -r
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from checkpoints" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from checkpoints" -l json -d 'One JSON object per line'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from checkpoints" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from dead-letters" -l pipeline -d 'Only this pipeline' -r
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from dead-letters" -l key -d 'Only this key' -r
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from dead-letters" -l limit -d 'At most this many lines' -r
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from dead-letters" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from dead-letters" -l json -d 'One JSON object per line'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from dead-letters" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from help" -f -a "log" -d 'Records in the replay log'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from help" -f -a "state" -d 'Per-key aggregate state'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from help" -f -a "dedup" -d 'The event-ID dedup ledger'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from help" -f -a "outbox" -d 'Results waiting for the broker\'s PUBACK'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from help" -f -a "checkpoints" -d 'Checkpoint history, newest last'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from help" -f -a "dead-letters" -d 'Refused inputs with offset, topic and reason'
complete -c cairn -n "__fish_cairn_using_subcommand inspect; and __fish_seen_subcommand_from help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c cairn -n "__fish_cairn_using_subcommand verify" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand verify" -l repair -d 'Move damaged segments aside (never deleting them) so the log opens again'
complete -c cairn -n "__fish_cairn_using_subcommand verify" -l json
complete -c cairn -n "__fish_cairn_using_subcommand verify" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand status" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand status" -l json
complete -c cairn -n "__fish_cairn_using_subcommand status" -l offline -d 'Read the data directory even if the agent\'s metrics answer'
complete -c cairn -n "__fish_cairn_using_subcommand status" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and not __fish_seen_subcommand_from create list restore help" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and not __fish_seen_subcommand_from create list restore help" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and not __fish_seen_subcommand_from create list restore help" -f -a "create" -d 'Write a savepoint of the last checkpoint (only while the agent is stopped)'
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and not __fish_seen_subcommand_from create list restore help" -f -a "list" -d 'Savepoints in the data directory, oldest first (in the order they were taken)'
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and not __fish_seen_subcommand_from create list restore help" -f -a "restore" -d 'Rebuild the store from a savepoint; the previous store is moved aside, never deleted'
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and not __fish_seen_subcommand_from create list restore help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and __fish_seen_subcommand_from create" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and __fish_seen_subcommand_from create" -l json
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and __fish_seen_subcommand_from create" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and __fish_seen_subcommand_from list" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and __fish_seen_subcommand_from list" -l json
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and __fish_seen_subcommand_from list" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and __fish_seen_subcommand_from restore" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and __fish_seen_subcommand_from restore" -l latest -d 'The newest savepoint in the data directory (the last taken, whatever its checkpoint ID)'
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and __fish_seen_subcommand_from restore" -l json
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and __fish_seen_subcommand_from restore" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and __fish_seen_subcommand_from help" -f -a "create" -d 'Write a savepoint of the last checkpoint (only while the agent is stopped)'
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and __fish_seen_subcommand_from help" -f -a "list" -d 'Savepoints in the data directory, oldest first (in the order they were taken)'
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and __fish_seen_subcommand_from help" -f -a "restore" -d 'Rebuild the store from a savepoint; the previous store is moved aside, never deleted'
complete -c cairn -n "__fish_cairn_using_subcommand savepoint; and __fish_seen_subcommand_from help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c cairn -n "__fish_cairn_using_subcommand outbox; and not __fish_seen_subcommand_from list drop help" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand outbox; and not __fish_seen_subcommand_from list drop help" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand outbox; and not __fish_seen_subcommand_from list drop help" -f -a "list" -d 'Results waiting in the outbox: sequence, output ID, topic, payload (as `inspect outbox`)'
complete -c cairn -n "__fish_cairn_using_subcommand outbox; and not __fish_seen_subcommand_from list drop help" -f -a "drop" -d 'Give up one waiting result for good (agent stopped): it leaves the outbox for every sink and becomes a dead letter `dropped_by_operator`'
complete -c cairn -n "__fish_cairn_using_subcommand outbox; and not __fish_seen_subcommand_from list drop help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c cairn -n "__fish_cairn_using_subcommand outbox; and __fish_seen_subcommand_from list" -l pipeline -d 'Only this pipeline' -r
complete -c cairn -n "__fish_cairn_using_subcommand outbox; and __fish_seen_subcommand_from list" -l key -d 'Only this key' -r
complete -c cairn -n "__fish_cairn_using_subcommand outbox; and __fish_seen_subcommand_from list" -l limit -d 'At most this many lines' -r
complete -c cairn -n "__fish_cairn_using_subcommand outbox; and __fish_seen_subcommand_from list" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand outbox; and __fish_seen_subcommand_from list" -l json -d 'One JSON object per line'
complete -c cairn -n "__fish_cairn_using_subcommand outbox; and __fish_seen_subcommand_from list" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand outbox; and __fish_seen_subcommand_from drop" -s c -l config -d 'Configuration file' -r -F
complete -c cairn -n "__fish_cairn_using_subcommand outbox; and __fish_seen_subcommand_from drop" -l json
complete -c cairn -n "__fish_cairn_using_subcommand outbox; and __fish_seen_subcommand_from drop" -s h -l help -d 'Print help'
complete -c cairn -n "__fish_cairn_using_subcommand outbox; and __fish_seen_subcommand_from help" -f -a "list" -d 'Results waiting in the outbox: sequence, output ID, topic, payload (as `inspect outbox`)'
complete -c cairn -n "__fish_cairn_using_subcommand outbox; and __fish_seen_subcommand_from help" -f -a "drop" -d 'Give up one waiting result for good (agent stopped): it leaves the outbox for every sink and becomes a dead letter `dropped_by_operator`'
complete -c cairn -n "__fish_cairn_using_subcommand outbox; and __fish_seen_subcommand_from help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c cairn -n "__fish_cairn_using_subcommand help; and not __fish_seen_subcommand_from run validate inspect verify status savepoint outbox help" -f -a "run" -d 'Run the agent in the foreground until SIGINT/SIGTERM (drains, exits 0); SIGHUP reloads the safe parts of the config'
complete -c cairn -n "__fish_cairn_using_subcommand help; and not __fish_seen_subcommand_from run validate inspect verify status savepoint outbox help" -f -a "validate" -d 'Check the configuration; print every problem (exit 2) or a summary (exit 0)'
complete -c cairn -n "__fish_cairn_using_subcommand help; and not __fish_seen_subcommand_from run validate inspect verify status savepoint outbox help" -f -a "inspect" -d 'Look inside the log or the store (the store only while the agent is stopped)'
complete -c cairn -n "__fish_cairn_using_subcommand help; and not __fish_seen_subcommand_from run validate inspect verify status savepoint outbox help" -f -a "verify" -d 'Check the log (and the store against it); `--repair` moves damaged log segments aside'
complete -c cairn -n "__fish_cairn_using_subcommand help; and not __fish_seen_subcommand_from run validate inspect verify status savepoint outbox help" -f -a "status" -d 'The running agent\'s figures (from its socket in the data directory, or `[metrics] listen`), or the data directory\'s'
complete -c cairn -n "__fish_cairn_using_subcommand help; and not __fish_seen_subcommand_from run validate inspect verify status savepoint outbox help" -f -a "savepoint" -d 'Portable snapshots of the store: create (agent stopped), list, restore'
complete -c cairn -n "__fish_cairn_using_subcommand help; and not __fish_seen_subcommand_from run validate inspect verify status savepoint outbox help" -f -a "outbox" -d 'Results waiting to go out: list them, or drop one stuck result (agent stopped)'
complete -c cairn -n "__fish_cairn_using_subcommand help; and not __fish_seen_subcommand_from run validate inspect verify status savepoint outbox help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c cairn -n "__fish_cairn_using_subcommand help; and __fish_seen_subcommand_from inspect" -f -a "log" -d 'Records in the replay log'
complete -c cairn -n "__fish_cairn_using_subcommand help; and __fish_seen_subcommand_from inspect" -f -a "state" -d 'Per-key aggregate state'
complete -c cairn -n "__fish_cairn_using_subcommand help; and __fish_seen_subcommand_from inspect" -f -a "dedup" -d 'The event-ID dedup ledger'
complete -c cairn -n "__fish_cairn_using_subcommand help; and __fish_seen_subcommand_from inspect" -f -a "outbox" -d 'Results waiting for the broker\'s PUBACK'
complete -c cairn -n "__fish_cairn_using_subcommand help; and __fish_seen_subcommand_from inspect" -f -a "checkpoints" -d 'Checkpoint history, newest last'
complete -c cairn -n "__fish_cairn_using_subcommand help; and __fish_seen_subcommand_from inspect" -f -a "dead-letters" -d 'Refused inputs with offset, topic and reason'
complete -c cairn -n "__fish_cairn_using_subcommand help; and __fish_seen_subcommand_from savepoint" -f -a "create" -d 'Write a savepoint of the last checkpoint (only while the agent is stopped)'
complete -c cairn -n "__fish_cairn_using_subcommand help; and __fish_seen_subcommand_from savepoint" -f -a "list" -d 'Savepoints in the data directory, oldest first (in the order they were taken)'
complete -c cairn -n "__fish_cairn_using_subcommand help; and __fish_seen_subcommand_from savepoint" -f -a "restore" -d 'Rebuild the store from a savepoint; the previous store is moved aside, never deleted'
complete -c cairn -n "__fish_cairn_using_subcommand help; and __fish_seen_subcommand_from outbox" -f -a "list" -d 'Results waiting in the outbox: sequence, output ID, topic, payload (as `inspect outbox`)'
complete -c cairn -n "__fish_cairn_using_subcommand help; and __fish_seen_subcommand_from outbox" -f -a "drop" -d 'Give up one waiting result for good (agent stopped): it leaves the outbox for every sink and becomes a dead letter `dropped_by_operator`'
