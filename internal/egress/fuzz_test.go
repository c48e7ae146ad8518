package egress

import (
	"reflect"
	"strings"
	"testing"
)

// FuzzParse: Parse never panics, everything it accepts renders back to a
// string that parses to the same entries, and every accepted entry is
// well-formed.
func FuzzParse(f *testing.F) {
	for _, s := range []string{
		"10.0.0.5:443/tcp", "10.0.0.0/8:8000-8080/udp, 192.0.2.1:*/tcp",
		"[2001:db8::/32]:443/tcp", "mirror.example.com:5000/tcp", "none", "",
		"[::ffff:10.0.0.1]:1/udp", "10.1.2.3/8:443/tcp", "a:1-65535/udp",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		es, err := Parse(s)
		if err != nil {
			return
		}
		parts := make([]string, len(es))
		for i, e := range es {
			if e.Proto != TCP && e.Proto != UDP || e.Ports.Lo == 0 || e.Ports.Lo > e.Ports.Hi {
				t.Fatalf("Parse(%q) accepted %+v", s, e)
			}
			if e.Host == "" && (!e.Prefix.IsValid() || e.Prefix.Masked() != e.Prefix) {
				t.Fatalf("Parse(%q) accepted prefix %v", s, e.Prefix)
			}
			parts[i] = e.String()
		}
		again, err := Parse(strings.Join(parts, ","))
		if err != nil || !reflect.DeepEqual(again, es) {
			t.Fatalf("Parse(%q) = %v; rendered %q parses to %v, %v", s, es, parts, again, err)
		}
	})
}
