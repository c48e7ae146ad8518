// Package arbiter carries envlet's node quota arbitration over ttrpc: a
// server that exposes an in-memory envlet.NodeArbiter on a unix socket (the
// node daemon), and a client that implements envlet.Arbiter for the shims.
//
// There is no protoc in this build, so the wire format is deliberately
// small: one ttrpc service whose every request and response is a
// google.protobuf.BytesValue carrying a JSON document (the types below).
// ttrpc frames and errors (gRPC status codes, mapped to errdefs kinds with
// errgrpc) are unchanged, so any ttrpc client can speak it; docs/shim.md
// specifies the messages.
//
// The shims hold the truth about their environments. Every response names
// the arbiter instance (Boot); when a client sees a new Boot, or the arbiter
// does not know an environment, the client re-registers all of its
// environments with their current grants before anything else.
package arbiter

import (
	"encoding/json"
	"fmt"
	"time"

	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/envsnap/envsnap/internal/envlet"
)

// ServiceName is the ttrpc service the arbiter registers.
const ServiceName = "envsnap.arbiter.v1.Arbiter"

// DefaultSocket is where the node arbiter listens unless configured otherwise.
const DefaultSocket = "/run/envsnap/arbiter.sock"

// Method names of ServiceName.
const (
	methodAdmit    = "Admit"
	methodGrow     = "Grow"
	methodReport   = "Report"
	methodRelease  = "Release"
	methodList     = "List"
	methodTimeline = "Timeline"
	methodStart    = "Start"
)

// Resources is envlet.Resources on the wire.
type Resources struct {
	CPU    float64 `json:"cpu"`              // cores
	Memory int64   `json:"memory,omitempty"` // bytes
}

func toWire(r envlet.Resources) Resources   { return Resources{CPU: r.CPU, Memory: r.Memory} }
func fromWire(r Resources) envlet.Resources { return envlet.Resources{CPU: r.CPU, Memory: r.Memory} }

// AdmitRequest admits an environment with its base (initial) quota. A
// re-registration after an arbiter restart also carries the grant the
// environment currently holds, which the arbiter restores as far as it can.
type AdmitRequest struct {
	Env     string     `json:"env"`
	Base    Resources  `json:"base"`
	Current *Resources `json:"current,omitempty"`
	// Owner identifies the shim (for listings only).
	Owner string `json:"owner,omitempty"`
	// Priority orders environments for the node's victim policy.
	Priority int `json:"priority,omitempty"`
	// Tier is the CPU tier (latency, standard, besteffort; empty is
	// standard).
	Tier string `json:"tier,omitempty"`
}

// GrowRequest asks for the environment's limits to become Want.
type GrowRequest struct {
	Env  string    `json:"env"`
	Want Resources `json:"want"`
}

// ReportRequest is the ~1 Hz heartbeat of an environment: its current
// limits and usage, plus the controller's status and the timeline points
// recorded since the previous report, both as the controller's JSON.
type ReportRequest struct {
	Env      string            `json:"env"`
	Current  Resources         `json:"current"`
	Used     Resources         `json:"used"`
	Status   json.RawMessage   `json:"status,omitempty"`
	Timeline []json.RawMessage `json:"timeline,omitempty"`
	// Gaps is what the reporting shim's client counted since it started:
	// the times the arbiter stopped answering it, and its calls that got
	// no answer (timeouts, refused connects).
	Gaps *Gaps `json:"gaps,omitempty"`
}

// Gaps counts a client's lost contact with the arbiter.
type Gaps struct {
	Gaps        int `json:"gaps"`
	FailedCalls int `json:"failed_calls"`
}

// ReleaseRequest returns an environment's grant to the node.
type ReleaseRequest struct {
	Env string `json:"env"`
	// Reason is recorded in the listing of ended environments ("exited",
	// or the failure reason).
	Reason string `json:"reason,omitempty"`
	// A release the client could not send when the environment ended
	// carries when it was admitted and ended, and its base: the arbiter
	// lists an environment it never heard of (admitted by the client's
	// fallback while the arbiter was away) as ended from them.
	Base     *Resources `json:"base,omitempty"`
	Admitted time.Time  `json:"admitted,omitzero"`
	Ended    time.Time  `json:"ended,omitzero"`
}

// StartRequest asks for the environment's place in the node's start
// queue (envlet.StartQueue); Done says its start has ended.
type StartRequest struct {
	Env  string `json:"env"`
	Done bool   `json:"done,omitempty"`
}

// StartResponse answers Start: how many environments admitted before this
// one are still starting.
type StartResponse struct {
	Boot string `json:"boot"`
	Rank int    `json:"rank"`
}

// ResourcesResponse answers Grow (the grant) and Report (the limit the
// environment must not exceed; below its current limit means shrink).
type ResourcesResponse struct {
	Boot      string    `json:"boot"`
	Resources Resources `json:"resources"`
	// Evict (Report only): the node's victim policy chose this
	// environment to fail, and why.
	Evict string `json:"evict,omitempty"`
}

// EmptyResponse answers Admit and Release. Admit's answer carries the
// arbiter's view of the node, which the shims report in failures.
type EmptyResponse struct {
	Boot string    `json:"boot"`
	Node *NodeInfo `json:"node,omitempty"`
}

// NodeInfo is the node as the arbiter divides it.
type NodeInfo struct {
	Capacity Resources `json:"capacity"`
	Reserve  float64   `json:"reserve"`
}

// ListRequest asks for the environments the arbiter knows.
type ListRequest struct {
	// Ended includes recently ended environments.
	Ended bool `json:"ended,omitempty"`
}

// EnvInfo is one environment as the arbiter sees it.
type EnvInfo struct {
	Env      string          `json:"env"`
	Owner    string          `json:"owner,omitempty"`
	Base     Resources       `json:"base"`
	Current  Resources       `json:"current"`
	Used     Resources       `json:"used"`
	Status   json.RawMessage `json:"status,omitempty"`
	Admitted time.Time       `json:"admitted"`
	Updated  time.Time       `json:"updated"`
	Ended    time.Time       `json:"ended,omitzero"`
	Reason   string          `json:"reason,omitempty"`
	Priority int             `json:"priority,omitempty"`
	Tier     string          `json:"tier,omitempty"`
	// Gaps: as last reported by the environment's shim.
	Gaps *Gaps `json:"gaps,omitempty"`
}

// ListResponse answers List.
type ListResponse struct {
	Boot string    `json:"boot"`
	Envs []EnvInfo `json:"envs"`
}

// TimelineRequest asks for the recorded timeline of one environment.
type TimelineRequest struct {
	Env string `json:"env"`
}

// TimelineResponse carries the controller's timeline points as recorded.
type TimelineResponse struct {
	Boot   string            `json:"boot"`
	Points []json.RawMessage `json:"points"`
}

func encode(v any) (*wrapperspb.BytesValue, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("encode %T: %w", v, err)
	}
	return wrapperspb.Bytes(b), nil
}

func decode(m *wrapperspb.BytesValue, v any) error {
	if err := json.Unmarshal(m.GetValue(), v); err != nil {
		return fmt.Errorf("decode %T: %w", v, err)
	}
	return nil
}
