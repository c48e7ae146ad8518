package envlet

import "fmt"

// Failure is the explicit end of an environment: memory could not be
// granted while it was OOMing or stuck at its limit, it was not admitted,
// or it hit one of the shim's guard limits (pids, output, disk; Cap is the
// limit, Requested what was observed). The shim kills the task and publishes this (event, exit
// status, termination message). Sizes are bytes.
type Failure struct {
	Env    string `json:"id"`
	Reason string `json:"reason"` // MEM_NODE_EXHAUSTED | MEM_CAP_EXCEEDED | ARBITER_UNREACHABLE | ADMISSION_REJECTED | PIDS_EXHAUSTED | OUTPUT_CAP_EXCEEDED | DISK_CAP_EXCEEDED
	// Requested is what the task needed: for memory, the larger of its
	// limit and MemMinHeadroom x its working set (a need above the limit
	// when the working set is at it). Asked is the grow the policy asked
	// the node for (a x2 or x4 step), 0 when it asked for none.
	Requested  int64  `json:"requested"`
	Asked      int64  `json:"asked,omitempty"`
	Granted    int64  `json:"granted"`
	Cap        int64  `json:"cap"`
	WorkingSet int64  `json:"ws"`
	OOMs       int    `json:"ooms"`
	Message    string `json:"message"`
}

// FailureError is returned by Controller.Run when the environment must die.
type FailureError struct {
	Failure
	// Err is the underlying cause when there is one (the arbiter's
	// errdefs.ErrResourceExhausted on admission).
	Err error
}

func (e *FailureError) Error() string {
	return fmt.Sprintf("envlet: environment %s failed: %s: %s", e.Env, e.Reason, e.Message)
}

func (e *FailureError) Unwrap() error { return e.Err }

func (f *Failure) describe() string {
	switch f.Reason {
	case ReasonCapExceeded:
		return fmt.Sprintf("memory working set %s %s, above the per-environment cap %s (%d OOMs)",
			FormatBytes(f.WorkingSet), f.needs(), FormatBytes(f.Cap), f.OOMs)
	case ReasonNodeExhausted:
		return fmt.Sprintf("memory working set %s %s; the node granted none of the %s asked (%d OOMs)",
			FormatBytes(f.WorkingSet), f.needs(), FormatBytes(f.Asked), f.OOMs)
	case ReasonArbiterUnreachable:
		return fmt.Sprintf("memory working set %s %s; the node arbiter gave no answer while the task waited at its limit (%d OOMs)",
			FormatBytes(f.WorkingSet), f.needs(), f.OOMs)
	}
	return f.Reason
}

// needs says what the task needed: more than the limit it is stuck at,
// and how much at least when its working set tells.
func (f *Failure) needs() string {
	if f.Requested > f.Granted {
		return fmt.Sprintf("needs at least %s, above its %s limit", FormatBytes(f.Requested), FormatBytes(f.Granted))
	}
	return fmt.Sprintf("needs more than its %s limit", FormatBytes(f.Granted))
}
