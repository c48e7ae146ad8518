package arbiter

import (
	"context"
	"testing"

	"github.com/containerd/ttrpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/envsnap/envsnap/internal/envlet"
)

// FuzzServer feeds arbitrary request payloads to every method: the
// arbiter serves every shim on the node and must answer garbage with an
// error, never panic or corrupt its accounting.
func FuzzServer(f *testing.F) {
	for _, seed := range []string{
		`{"env":"a","base":{"cpu":1,"memory":1073741824}}`,
		`{"env":"a","want":{"cpu":2,"memory":2147483648}}`,
		`{"env":"a","current":{"cpu":2},"used":{"cpu":1},"status":{"CPUGrows":1},"timeline":[{"T":"2026-01-01T00:00:00Z"}]}`,
		`{"env":"a","reason":"exited"}`,
		`{"ended":true}`,
		`{"env":"a","done":true}`,
		`{"env":"a","base":{"cpu":-1,"memory":-5}}`,
		`{"env":"","base":{"cpu":1e308}}`,
		`not json`,
	} {
		f.Add([]byte(seed), uint8(0))
	}
	f.Fuzz(func(t *testing.T, payload []byte, order uint8) {
		ctx := context.Background()
		s := NewServer(envlet.NewNodeArbiter(envlet.Resources{CPU: 4, Memory: 4 << 30}, 0.15))
		srv, err := ttrpc.NewServer()
		if err != nil {
			t.Fatal(err)
		}
		defer srv.Close()
		desc := map[string]ttrpc.Method{
			methodAdmit: handler(s.admit), methodGrow: handler(s.grow), methodReport: handler(s.report),
			methodRelease: handler(s.release), methodList: handler(s.list), methodTimeline: handler(s.timelineOf),
			methodStart: handler(s.startRank),
		}
		names := []string{methodAdmit, methodGrow, methodReport, methodStart, methodRelease, methodList, methodTimeline}
		in, _ := proto.Marshal(wrapperspb.Bytes(payload))
		for i := range names {
			m := desc[names[(i+int(order))%len(names)]]
			_, _ = m(ctx, func(v any) error { return proto.Unmarshal(in, v.(proto.Message)) })
		}
		// The accounting invariant holds whatever was sent.
		g := s.arb.Granted()
		if g.CPU > 4+1e-9 || g.Memory > 4<<30 || g.CPU < 0 || g.Memory < 0 {
			t.Fatalf("grants %v exceed the node", g)
		}
	})
}
