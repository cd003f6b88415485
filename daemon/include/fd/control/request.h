// fd/control/request.h — wire → the one control command (fd/engine/control.h: ControlCommand).
//
// Every transport carries a control command in the same wire form, `shm::MailboxCommand` (op
// name, tags text, version, mode text, ...: the text fields of the shm mailbox, a fixed ABI that
// fdctl writes): the V1 and legacy HTTP routes and every vLLM/SGLang alias fill one from the
// request, the mailbox watcher reads one from the control block. parse_command is the only place
// a command is validated, so every transport accepts and refuses exactly the same commands.
#pragma once

#include "fd/engine/control.h"
#include "fd/shm/control_client.h"

namespace fd::control {

/// Validate a command in wire form and return the one command type. Checks the op name (the
/// wire names of fd/engine/control.h: "pause" ... "abort" ... "update_model_weight"), that tags
/// are only given to sleep/wakeup and name known tags (empty = both), the version syntax
/// ([A-Za-z0-9._-]{1,128}, not starting with '.'; only for update_weights and commit_weights),
/// verify_checksum and commit=false only for update_weights, mode (abort|wait|keep) only for
/// pause (all|device for flush_cache), request_id / abort_all only for abort (exactly one of
/// them), weight_dir / reload_base only for update_weights (absolute, at most 1023 bytes, not
/// staged). The result's gate and on_done are null (the transport sets the gate).
/// Errors  fd::Error{invalid_argument} with param() naming the offending field.
engine::ControlCommand parse_command(const shm::MailboxCommand & wire);

/// The op of wire name `name`. Errors  fd::Error{invalid_argument} (param "op") for an unknown name.
engine::ControlOp parse_op(std::string_view name);

/// The command posted in mailbox slot `b` (cmd_op, cmd_tags, cmd_version, ...), in wire form.
/// Reads the slot's command fields only; the caller owns the handshake (cmd_seq, cmd_state).
shm::MailboxCommand read_mailbox(const shm::MailboxSlot & b);

}  // namespace fd::control
