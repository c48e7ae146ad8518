package fetch

import "time"

// FillPolicy says when a background fill batch may go out. A fill takes
// the link that a container start needs, whichever layer it belongs to,
// so it yields to foreground work node-wide; its CPU and disk work
// (receiving, hashing, writing the cache) runs at idle priority
// (idleprio), so the kernel gives it only what the node's other work
// leaves, and nothing here waits for an idle core. Decide is a pure function of
// values: tests replay traces of foreground activity on a fake clock and
// assert the exact sequence of decisions; Flights does the waiting around
// it. Every duration is measured, with its reason, in docs/fetching.md
// ("Background fill"); DefaultFillPolicy holds the defaults.
type FillPolicy struct {
	// Quiet: no batch starts while a foreground read waits on the
	// network nor until Quiet after the last one. Container starts read
	// in bursts separated by process creation and dynamic loading, which
	// need the CPU too.
	Quiet time.Duration
	// AfterMount: nor until AfterMount after the last mount. Between the
	// mount of an image's layers and the container's first read,
	// containerd, the shim and runc set the container up without a read
	// to show for it (0.2-0.5 s here); a fill starting in that gap cost
	// a third more cold start in BenchmarkColdStart.
	AfterMount time.Duration
	// Startup: until Startup after the last mount, any file-system
	// activity (lookups, opens, reads) holds the fill back for Quiet too:
	// a container start is mostly metadata work whose timing a fill
	// stretches. Later only network waits do, so a busy workload cannot
	// starve the fill.
	Startup time.Duration
	// Calm: workers other than the first wait until no read at all (cache
	// hits included) arrived for Calm, so while a workload is active a
	// read queues behind at most one batch and one core stays with it.
	Calm time.Duration
	// MaxPause: the first worker, held back this long, sends one batch
	// anyway, so a workload that misses steadily cannot starve the fill;
	// node-wide at most one such batch per MaxPause, whichever layer it
	// belongs to: with 8 environments starting at once, a dozen layers
	// each forcing a batch every MaxPause would be a fill running at
	// full speed through the starts.
	MaxPause time.Duration
	// SmallLayer: once its fill has started, a layer whose chunks take at
	// most SmallLayer compressed bytes is fetched whole at its first
	// foreground miss, none of the holds above applying
	// (Layer.fillSmall). A task layer (a repository with its build
	// cache, 17.5 MiB in the benchmark) is read nearly in full by the
	// first build or test, one miss and round trip at a time, while its
	// fill waits for the CPU that build keeps busy. Zero turns it off.
	SmallLayer int64
	// Poll is how often a fill held back by a count (a read waiting, a
	// prefetch running) looks again; a fill held back by a
	// time looks again when that time has passed.
	Poll time.Duration
}

// DefaultFillPolicy returns the policy the daemon runs with.
func DefaultFillPolicy() FillPolicy {
	return FillPolicy{
		Quiet:      300 * time.Millisecond,
		AfterMount: time.Second,
		Startup:    10 * time.Second,
		Calm:       2 * time.Second,
		MaxPause:   2 * time.Second,
		SmallLayer: 32 << 20,
		Poll:       20 * time.Millisecond,
	}
}

// Foreground is the foreground work of a node at one moment, as Flights
// observed it: what FillPolicy.Decide reads. A zero time is "never".
type Foreground struct {
	Waiting     int       // foreground reads waiting on the network
	Prefetching int       // Prefetch calls in progress
	LastWait    time.Time // end of the latest foreground network wait
	LastMount   time.Time // creation of the latest yielding Layer
	LastOp      time.Time // latest file-system operation (Layer.NoteActivity)
	LastRead    time.Time // latest Layer.ReadChunk
	LastForced  time.Time // latest batch sent past MaxPause, node-wide
}

// FillHold is why a fill batch waits (FillSend: it does not).
type FillHold int

const (
	FillSend     FillHold = iota
	HoldWaiting           // a foreground read waits on the network
	HoldPrefetch          // a prefetch is running
	HoldQuiet             // a network wait ended less than Quiet ago
	HoldMount             // a layer was mounted less than AfterMount ago
	HoldStartup           // file-system activity during a start
	HoldCalm              // reads less than Calm ago (workers after the first)
)

var fillHoldNames = [...]string{"send", "waiting", "prefetch", "quiet", "mount", "startup", "calm"}

func (h FillHold) String() string { return fillHoldNames[h] }

// FillDecision is the outcome of Decide: send now, or hold and look again
// at Until (foreground activity can only push that later). Forced marks a
// send past MaxPause despite foreground work.
type FillDecision struct {
	Hold   FillHold
	Until  time.Time
	Forced bool
}

// Send reports whether the batch may go out now.
func (d FillDecision) Send() bool { return d.Hold == FillSend }

// Decide says whether fill worker w (0 is the first of a layer's fill
// workers), held back since heldSince, may send a batch at now.
func (p FillPolicy) Decide(now time.Time, fg Foreground, w int, heldSince time.Time) FillDecision {
	hold := FillSend
	var until time.Time
	// note records a reason to hold until t; the decision can change only
	// once every reason has passed, so until is the latest of them.
	note := func(h FillHold, t time.Time) {
		if !now.Before(t) {
			return
		}
		if hold == FillSend {
			hold = h
		}
		if t.After(until) {
			until = t
		}
	}
	poll := now.Add(p.Poll)
	if fg.Waiting > 0 {
		note(HoldWaiting, poll)
	}
	if fg.Prefetching > 0 {
		note(HoldPrefetch, poll)
	}
	note(HoldQuiet, fg.LastWait.Add(p.Quiet))
	note(HoldMount, fg.LastMount.Add(p.AfterMount))
	if now.Before(fg.LastMount.Add(p.Startup)) {
		// Activity holds the fill only until the start-up window closes.
		note(HoldStartup, minTime(fg.LastOp.Add(p.Quiet), fg.LastMount.Add(p.Startup)))
	}
	if w == 0 {
		if hold == FillSend {
			return FillDecision{}
		}
		pause := heldSince
		if fg.LastForced.After(pause) {
			pause = fg.LastForced
		}
		pause = pause.Add(p.MaxPause)
		if !now.Before(pause) {
			return FillDecision{Forced: true}
		}
		return FillDecision{Hold: hold, Until: minTime(until, pause)}
	}
	note(HoldCalm, fg.LastRead.Add(p.Calm))
	if hold == FillSend {
		return FillDecision{}
	}
	return FillDecision{Hold: hold, Until: until}
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// PrefetchPolicy shapes Layer.Prefetch: the list is in first-read order;
// each window of it is sorted by offset and coalesced into requests, so
// nearby frames share a request while frames needed first still arrive
// first. The defaults (DefaultPrefetchPolicy) are justified in
// docs/fetching.md ("Prefetch lists").
type PrefetchPolicy struct {
	// Window is how many compressed bytes of the list are sorted and
	// coalesced together.
	Window int64
	// Batch bounds one request; Parallel bounds one layer's requests in
	// flight, Inflight the node's (every layer sharing the Flights).
	Batch    int64
	Parallel int
	Inflight int
	// Lead: a request waits until this long before it is due (its first
	// frame's time in the recorded run). Frames the recorded run read
	// seconds after the start (a test build) would otherwise be fetched,
	// verified and written while the container starts, taking CPU and
	// link from what the start needs.
	Lead time.Duration
}

// DefaultPrefetchPolicy returns the prefetch shape the daemon runs with.
// One round trip of the link we are measured on carries ~2.5 MB: a few
// requests of up to 4 MiB in flight keep it full, node-wide; more only
// split the link between layers.
func DefaultPrefetchPolicy() PrefetchPolicy {
	return PrefetchPolicy{
		Window:   16 << 20,
		Batch:    4 << 20,
		Parallel: 4,
		Inflight: 6,
		Lead:     1500 * time.Millisecond,
	}
}
