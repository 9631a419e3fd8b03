package extproc

import (
	"math"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// The dynamic metadata is written straight in protobuf's wire format and attached to the reply
// as its dynamic_metadata field's bytes: Envoy (and any other reader) decodes an ordinary
// google.protobuf.Struct. Building a Struct instead costs a map, a Value and a oneof wrapper per
// key, and its reflective marshalling was the largest part of the server's own marshalling
// cost per stream.

// Field numbers of the messages written here (envoy.service.ext_proc.v3.ProcessingResponse,
// google.protobuf.Struct, its map entry and google.protobuf.Value). TestMetadataWireFieldNumbers
// checks them against the generated descriptors.
const (
	fieldResponseDynamicMetadata protowire.Number = 8
	fieldStructFields            protowire.Number = 1
	fieldEntryKey                protowire.Number = 1
	fieldEntryValue              protowire.Number = 2
	fieldValueNumber             protowire.Number = 2
	fieldValueString             protowire.Number = 3
	fieldValueBool               protowire.Number = 4
	fieldValueStruct             protowire.Number = 5
)

// metadataWriter appends one Struct's fields. Each field is a map entry holding a Value; the
// sizes are known before anything is written, so nothing is copied twice.
type metadataWriter struct{ b []byte }

func (w *metadataWriter) entry(key string, valueField protowire.Number, valueSize int) {
	value := protowire.SizeTag(valueField) + valueSize
	entry := protowire.SizeTag(fieldEntryKey) + protowire.SizeBytes(len(key)) +
		protowire.SizeTag(fieldEntryValue) + protowire.SizeBytes(value)
	w.b = protowire.AppendTag(w.b, fieldStructFields, protowire.BytesType)
	w.b = protowire.AppendVarint(w.b, uint64(entry))
	w.b = protowire.AppendTag(w.b, fieldEntryKey, protowire.BytesType)
	w.b = protowire.AppendString(w.b, key)
	w.b = protowire.AppendTag(w.b, fieldEntryValue, protowire.BytesType)
	w.b = protowire.AppendVarint(w.b, uint64(value))
}

func (w *metadataWriter) str(key, v string) {
	w.entry(key, fieldValueString, protowire.SizeBytes(len(v)))
	w.b = protowire.AppendTag(w.b, fieldValueString, protowire.BytesType)
	w.b = protowire.AppendString(w.b, v)
}

func (w *metadataWriter) num(key string, v float64) {
	w.entry(key, fieldValueNumber, protowire.SizeFixed64())
	w.b = protowire.AppendTag(w.b, fieldValueNumber, protowire.Fixed64Type)
	w.b = protowire.AppendFixed64(w.b, math.Float64bits(v))
}

func (w *metadataWriter) boolean(key string, v bool) {
	w.entry(key, fieldValueBool, protowire.SizeVarint(protowire.EncodeBool(v)))
	w.b = protowire.AppendTag(w.b, fieldValueBool, protowire.VarintType)
	w.b = protowire.AppendVarint(w.b, protowire.EncodeBool(v))
}

// metadataFields writes the request's metadata fields (the namespace's Struct, without its
// envelope) to w: classification, decision and, once settled, usage.
func (p *processor) metadataFields(w *metadataWriter) {
	d := p.decision
	s := p.snap
	w.str("feature", s.FeatureName(d.Dims.Feature))
	w.str("tenant", d.Dims.Tenant)
	w.str("tier", s.TierName(d.Dims.Tier))
	w.str("provider", s.ProviderName(d.Dims.Provider))
	w.str("model", d.Dims.Model)
	w.num("estimated_tokens", float64(p.estimate.Total))
	switch {
	case d.Verdict != policy.Admit:
		w.str("decision", "rejected")
		w.str("reason", string(d.Reason))
		w.str("compartment", d.Compartment)
	case d.Rerouted:
		w.str("decision", "rerouted")
		w.str("reason", string(d.Reason))
		w.str("compartment", p.compartments)
	default:
		w.str("decision", "admitted")
		w.str("compartment", p.compartments)
	}
	if p.final && d.Verdict == policy.Admit {
		st, u := p.settled, p.outcome.Usage
		w.num("prompt_tokens", float64(st.Prompt))
		w.num("completion_tokens", float64(st.Completion))
		w.num("total_tokens", float64(st.Total))
		w.num("cached_tokens", float64(u.Cached))
		w.num("reasoning_tokens", float64(u.Reasoning))
		w.boolean("usage_reported", u.Known)
	}
}

// metadataBytes returns the reply's dynamic_metadata field, tag included, in wire format:
// a Struct with the policy's namespace holding the request's fields. It returns nil when
// nothing was decided (no metadata to leave).
func (p *processor) metadataBytes() []byte {
	if p.snap == nil || !p.decided {
		return nil
	}
	// The namespace's fields first, at the end of a buffer big enough for all of it; then the
	// envelopes, whose lengths depend on them, in front.
	inner := metadataWriter{b: make([]byte, 0, 512)}
	p.metadataFields(&inner)
	ns := p.snap.Policy.Envoy.MetadataNamespace
	nsValue := protowire.SizeTag(fieldValueStruct) + protowire.SizeBytes(len(inner.b))
	nsEntry := protowire.SizeTag(fieldEntryKey) + protowire.SizeBytes(len(ns)) +
		protowire.SizeTag(fieldEntryValue) + protowire.SizeBytes(nsValue)
	outer := protowire.SizeTag(fieldStructFields) + protowire.SizeBytes(nsEntry)
	b := make([]byte, 0, protowire.SizeTag(fieldResponseDynamicMetadata)+protowire.SizeBytes(outer))
	b = protowire.AppendTag(b, fieldResponseDynamicMetadata, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(outer))
	w := metadataWriter{b: b}
	w.entry(ns, fieldValueStruct, protowire.SizeBytes(len(inner.b)))
	w.b = protowire.AppendTag(w.b, fieldValueStruct, protowire.BytesType)
	w.b = protowire.AppendBytes(w.b, inner.b)
	return w.b
}

// withMetadata attaches the request's dynamic metadata to resp, which must be a reply built
// for this stream (never a shared one), and returns it.
func (p *processor) withMetadata(resp *extprocv3.ProcessingResponse) *extprocv3.ProcessingResponse {
	if b := p.metadataBytes(); b != nil {
		resp.ProtoReflect().SetUnknown(protoreflect.RawFields(b))
	}
	return resp
}
