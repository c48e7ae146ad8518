package peer

import (
	"context"
	"net"
	"strings"
	"testing"

	"golang.org/x/net/dns/dnsmessage"
)

// dnsServer answers UDP DNS queries from records: SRV and A by name. It is
// what a headless Service looks like to the resolver.
func dnsServer(t *testing.T, srv map[string][]dnsmessage.SRVResource, a map[string][][4]byte) *net.Resolver {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			var p dnsmessage.Parser
			h, err := p.Start(buf[:n])
			if err != nil {
				continue
			}
			q, err := p.Question()
			if err != nil {
				continue
			}
			name := strings.TrimSuffix(q.Name.String(), ".")
			b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true})
			b.StartQuestions()
			b.Question(q)
			b.StartAnswers()
			rh := dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 5}
			switch q.Type {
			case dnsmessage.TypeSRV:
				for _, r := range srv[name] {
					b.SRVResource(rh, r)
				}
			case dnsmessage.TypeA:
				for _, ip := range a[name] {
					b.AResource(rh, dnsmessage.AResource{A: ip})
				}
			}
			out, err := b.Finish()
			if err == nil {
				pc.WriteTo(out, from)
			}
		}
	}()
	addr := pc.LocalAddr().String()
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "udp", addr)
	}}
}

func TestLookupDNS(t *testing.T) {
	r := dnsServer(t,
		map[string][]dnsmessage.SRVResource{
			"peers-srv.test": {
				{Port: 9168, Target: dnsmessage.MustNewName("node-a.test.")},
				{Port: 9169, Target: dnsmessage.MustNewName("node-b.test.")},
			},
		},
		map[string][][4]byte{
			"node-a.test":    {{10, 0, 0, 1}},
			"node-b.test":    {{10, 0, 0, 2}},
			"peers-a.test":   {{10, 0, 0, 3}, {10, 0, 0, 4}},
			"peers-srv.test": {{10, 9, 9, 9}},
		})
	ctx := context.Background()
	got, err := LookupDNS(ctx, r, "peers-srv.test", 9168)
	if err != nil {
		t.Fatal(err)
	}
	if s := strings.Join(normalize(got), " "); s != "10.0.0.1:9168 10.0.0.2:9169" {
		t.Errorf("SRV members %s", s)
	}
	got, err = LookupDNS(ctx, r, "peers-a.test", 9168)
	if err != nil {
		t.Fatal(err)
	}
	if s := strings.Join(normalize(got), " "); s != "10.0.0.3:9168 10.0.0.4:9168" {
		t.Errorf("A members %s", s)
	}
	if _, err := LookupDNS(ctx, r, "absent.test", 9168); err == nil {
		t.Error("a name without records gave members")
	}
}
